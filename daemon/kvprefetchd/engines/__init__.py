"""Engine registry: one table from the configured engine and a warm mode to a native engine.

Each engine is named by what it is called (ping, stats, the config) and the warm mode
it implements, and is a row of C's one engine table (native/prefetch.c, listed by
kvp_engines), which also says of each whether it can run here (kvp_engine_detect) and
which kind it is: pread/read and fadvise/advise run in the asynchronous queue
(native/queue.c: persistent threads whose reads in flight follow each root's file
system, engines/queue.py), io_uring/read and io_uring/advise in batches (BatchEngine).
ENGINE_TABLE says which serves each configured `engine` in each warm mode; AUTO_ORDER
is what `auto` tries, best first.

`auto` picks by measurement, not by reputation (bench/run, same files, same run;
README "Performance"). In read mode the pread engine beat io_uring reads on the local
disk (0.86x on 2,000 1 MiB heads, 0.82x on 20,000 whole 256 KiB files, with 16
threads; with cold metadata the opens cost more than the reads and threads open in
parallel where a ring's submitter opens one file after another), and on a slow tier
only a depth that follows the tier keeps it busy (issue 13: a fixed 16 threads per
worker left 100 ms fetches 6-7x slower than the best pool).

The supervisor detects once and logs why an engine is passed over; each worker
then builds the first candidate that works for it, so a ring refused inside a
worker (seccomp, a memory limit) degrades to the fallback instead of failing
the boot. Warm modes travel by name ("read", "advise"): `engine_candidates`
and `WarmEngines` take one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvprefetchd.engines.base import BatchEngine, Engine, EngineSettings
from kvprefetchd.engines.queue import QueueEngine
from kvprefetchd.native import NativeUnavailable, load_native
from kvprefetchd.protocol import WARM_MODES

log = logging.getLogger("kvprefetchd.engines")


class NoEngine(RuntimeError):
    """The configured engine cannot run here; the message says why."""


@dataclass(frozen=True)
class EngineSpec:
    """An engine (as ping and stats name it) and its warm mode: a row of C's table."""

    name: str
    warm_mode: str

    def unavailable_reason(self) -> str | None:
        """None when this engine can run here, else why not (kvp_engine_detect)."""
        try:
            native = load_native()
        except NativeUnavailable as error:
            return str(error)
        return native.engine_unavailable(self.name, self.warm_mode)

    @property
    def queued(self) -> bool:
        """Whether C's table runs it in the queue (else in batches, or nowhere)."""
        return load_native().engine_queued(self.name, self.warm_mode)

    def build(self, settings: EngineSettings) -> Engine:
        if self.queued:
            return QueueEngine(self.name, self.warm_mode, settings)
        return BatchEngine(self.name, self.warm_mode, settings)


PREAD = EngineSpec("pread", "read")
FADVISE = EngineSpec("fadvise", "advise")
URING_READ = EngineSpec("io_uring", "read")
URING_ADVISE = EngineSpec("io_uring", "advise")

# configured engine -> warm mode -> the native engine that serves it.
ENGINE_TABLE: Mapping[str, Mapping[str, EngineSpec]] = {
    # pread has no advise form: posix_fadvise(WILLNEED) is the portable one.
    "pread": {"read": PREAD, "advise": FADVISE},
    # fadvise only advises; its confirming pread makes `read` true of it in read mode too.
    "fadvise": {"read": FADVISE, "advise": FADVISE},
    "io_uring": {"read": URING_READ, "advise": URING_ADVISE},
}

# What `auto` tries per warm mode, best first (measured: see the module's docstring).
AUTO_ORDER: Mapping[str, tuple[str, ...]] = {
    "read": ("pread", "io_uring"),
    "advise": ("fadvise", "io_uring"),
}


def engine_spec(name: str, warm_mode: str) -> EngineSpec:
    """The native engine serving a configured engine name in a warm mode."""
    if warm_mode not in WARM_MODES:
        raise NoEngine(f"unknown warm mode {warm_mode!r}")
    try:
        return ENGINE_TABLE[name][warm_mode]
    except KeyError:
        raise NoEngine(f"unknown engine {name!r}") from None


def engine_candidates(name: str, warm_mode: str) -> tuple[EngineSpec, ...]:
    """The engines to try, best first; explicit names allow no fallback."""
    if name != "auto":
        chosen = engine_spec(name, warm_mode)
        reason = chosen.unavailable_reason()
        if reason is not None:
            raise NoEngine(f"engine {name} is unavailable: {reason}")
        return (chosen,)
    if warm_mode not in AUTO_ORDER:
        raise NoEngine(f"unknown warm mode {warm_mode!r}")
    candidates = []
    for option in AUTO_ORDER[warm_mode]:
        spec = engine_spec(option, warm_mode)
        reason = spec.unavailable_reason()
        if reason is None:
            candidates.append(spec)
        else:
            log.info("engine auto: passing over %s: %s", option, reason)
    if not candidates:
        raise NoEngine("no engine can run here (is the native extension built?)")
    return tuple(candidates)


def build_engine(candidates: Sequence[EngineSpec], settings: EngineSettings, who: str) -> Engine:
    """The first candidate that sets up here; the last one's error if none does."""
    failure: Exception | None = None
    for spec in candidates:
        try:
            return spec.build(settings)
        except Exception as error:
            log.warning("%s: engine %s: %s", who, spec.name, error)
            failure = error
    if failure is None:
        raise RuntimeError("no engine to build")
    raise failure


class WarmEngines:
    """A worker's engines by warm mode name, each built on first use from that mode's candidates.

    A mode whose candidates are missing or all fail to set up is served by the
    default mode's engine (warned once), as a model profile asking for advice
    where no advice engine runs still gets its files warmed.
    """

    def __init__(
        self,
        candidates: Mapping[str, Sequence[EngineSpec]],
        default_mode: str,
        settings: EngineSettings,
        who: str,
    ) -> None:
        self._candidates = candidates
        self._settings = settings
        self._who = who
        self.default_mode = default_mode
        self._built: dict[str, Engine] = {}

    @property
    def default(self) -> Engine:
        """The configured warm mode's engine: built first, and its failure is the worker's."""
        engine = self._built.get(self.default_mode)
        if engine is None:
            engine = build_engine(self._candidates.get(self.default_mode, ()), self._settings,
                                  self._who)
            self._built[self.default_mode] = engine
        return engine

    def built(self) -> list[Engine]:
        """Every distinct engine built so far (a mode served by another's is listed once)."""
        unique: dict[int, Engine] = {id(engine): engine for engine in self._built.values()}
        return list(unique.values())

    def for_mode(self, warm_mode: str) -> Engine:
        """The engine for a warm mode by name; the default one where that mode has none."""
        if warm_mode == self.default_mode:
            return self.default
        engine = self._built.get(warm_mode)
        if engine is None:
            try:
                engine = build_engine(self._candidates.get(warm_mode, ()), self._settings,
                                      self._who)
            except Exception as error:
                engine = self.default
                log.warning("%s: warm mode %s unavailable (%s); using %s", self._who,
                            warm_mode, error, engine.name)
            self._built[warm_mode] = engine
        return engine
