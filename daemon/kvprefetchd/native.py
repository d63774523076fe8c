"""The one place that imports the cffi extension, so a missing build is one clear error.

It also reads the header's constants once, so Python never copies them: each
`#define KVP_<PREFIX>_<NAME> <code>` of native/kvprefetch.h becomes the name
`<name>` (lower case), which is the protocol's outcome name (KVP_OUT_*), check state
(KVP_CHK_*) or the config's residency rule (KVP_RES_*).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple


class NativeUnavailable(RuntimeError):
    """The compiled extension (native/*.c) is missing or cannot be loaded."""


def header_constants(lib: Any, prefix: str) -> dict[str, int]:
    """{name: code} of the lib's integer constants KVP_<prefix>_<NAME>, names lower-cased."""
    start = f"KVP_{prefix}_"
    return {
        attribute[len(start) :].lower(): int(getattr(lib, attribute))
        for attribute in dir(lib)
        if attribute.startswith(start)
    }


class EngineRow(NamedTuple):
    """A row of C's engine table (kvp_engines): every engine, of either kind."""

    engine: str
    warm_mode: str
    queued: bool  # run by the asynchronous queue (kvp_queue_new), else in batches (kvp_ctx_new)


class Native:
    def __init__(self, ffi: Any, lib: Any) -> None:
        self.ffi = ffi
        self.lib = lib
        # KVP_OUT_* code -> protocol outcome name (docs/protocol.md, "Per-file outcomes").
        self.outcome_names = {code: name for name, code in header_constants(lib, "OUT").items()}
        # KVP_CHK_* code -> check state (docs/protocol.md, "Check states").
        self.check_states = {code: name for name, code in header_constants(lib, "CHK").items()}
        # Residency rule name (config: off, tier, pagecache) -> KVP_RES_* code.
        self.rule_codes = header_constants(lib, "RES")

    def engines(self) -> list[EngineRow]:
        """The C engine table, in its order (kvp_engines)."""
        count = self.lib.kvp_engines(self.ffi.NULL, 0)
        table = self.ffi.new("struct kvp_engine_name[]", count)
        self.lib.kvp_engines(table, count)
        return [EngineRow(self._text(entry.engine), self._text(entry.warm_mode),
                          bool(entry.queued)) for entry in table]

    def engine_queued(self, engine: str, warm_mode: str) -> bool:
        """Whether C's table runs (engine, warm mode) in the queue; False for a batch engine
        and for a pair it does not have (which kvp_ctx_new then refuses: EINVAL)."""
        return any(row.queued for row in self.engines()
                   if (row.engine, row.warm_mode) == (engine, warm_mode))

    def engine_unavailable(self, engine: str, warm_mode: str) -> str | None:
        """None when the C table's (engine, warm mode) can run here, else why not."""
        why = self.ffi.new("char[]", 256)
        if self.lib.kvp_engine_detect(engine.encode(), warm_mode.encode(), why, len(why)):
            return None
        return self._text(why)

    def _text(self, pointer: Any) -> str:
        return str(self.ffi.string(pointer).decode(errors="replace"))


@functools.cache
def load_native() -> Native:
    try:
        from kvprefetchd._native import ffi, lib
    except ImportError as error:
        raise NativeUnavailable(
            f"the native extension is not built ({error}); reinstall with `pip install .`"
        ) from error
    return Native(ffi, lib)
