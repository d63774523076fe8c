"""io_uring: batched reads of file heads through liburing, or ring-issued WILLNEED.

The ring is created once per worker and reused for every batch. `read` mode
issues IORING_OP_READ in chunks at the configured queue depth; `advise` mode
issues IORING_OP_FADVISE and confirms as the fadvise engine does.
"""

from __future__ import annotations

from kvprefetchd.engines.base import Engine
from kvprefetchd.native import NativeUnavailable, load_native


class UringEngine(Engine):
    name = "io_uring"
    native_engine = "KVP_ENGINE_URING_READ"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            native = load_native()
        except NativeUnavailable as error:
            return str(error)
        why = native.ffi.new("char[]", 256)
        if native.lib.kvp_uring_probe(why, 256):
            return None
        return str(native.ffi.string(why).decode(errors="replace"))


class UringAdviseEngine(UringEngine):
    native_engine = "KVP_ENGINE_URING_FADVISE"
