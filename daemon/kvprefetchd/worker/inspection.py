"""check and evict in a worker: kvp_inspect over a list of files, in parallel off-host.

On a local root a look costs microseconds (a lookup and a cachestat), so it runs on the
worker's thread between rounds. On a network or FUSE root every open is a round trip
(s3fs: two HEAD requests, 13-16 s for 500 files in one thread), so the list is cut in
slices looked at by INSPECT_THREADS threads at once, as warm-ups read in parallel; cffi
lets go of the GIL inside the call.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvprefetchd.engines.base import WarmItem, native_batch
from kvprefetchd.native import Native

INSPECT_THREADS = 16


@dataclass(frozen=True, slots=True)
class Look:
    """What a look found of one file: its state, errno, size, bytes cached, and bytes
    in its file system's own cache (`tier`)."""

    state: str
    err: int
    size: int
    cached: int
    tier: int


class Inspector:
    def __init__(self, native: Native) -> None:
        self._native = native
        self._pool: ThreadPoolExecutor | None = None  # made on the first remote list

    def look(self, action: int, items: list[WarmItem], remote: bool) -> list[Look]:
        if not remote or len(items) < 2:
            return self._look(action, items)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(INSPECT_THREADS, "kvprefetchd-inspect")
        step = -(-len(items) // INSPECT_THREADS)
        slices = [items[i:i + step] for i in range(0, len(items), step)]
        looks: list[Look] = []
        for part in self._pool.map(lambda part: self._look(action, part), slices):
            looks.extend(part)
        return looks

    def _look(self, action: int, items: list[WarmItem]) -> list[Look]:
        ffi, lib = self._native.ffi, self._native.lib
        states = self._native.check_states
        native, keep = native_batch(ffi, items)
        out: Any = ffi.new("struct kvp_inspect_out[]", len(items))
        lib.kvp_inspect(action, native, out, len(items))
        del keep
        return [Look(states[r.state], int(r.err), int(r.size), int(r.cached), int(r.tier))
                for r in out]
