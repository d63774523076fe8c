"""Hold-open warming: warmed files kept open until their consumer has opened them.

Some file systems keep a file's data only while someone has it open. s3fs without
`kernel_cache` is the one measured here: the kernel drops a FUSE file's cached pages at
every open (no keep_cache), and s3fs throws its temporary copy away at the last close,
so a warmer that reads and closes leaves nothing behind: the consumer fetched every
object again (issue 24: 46 s after a warm-up as before it). A warmer that keeps the file
open leaves s3fs's copy (and its attributes) in place, and the consumer's open and reads
are served from it: 0.9-1.0 s instead of 27-46 s, no request to the endpoint.

So on such a root (tiers.py: keep = "hold") the queue engine hands back the fd each file
was read through (KVP_ITEM_HOLD) and the worker keeps it here, until:
- another process opens the file (inotify IN_OPEN on the inode, native/watch.c): the
  consumer's own fd keeps the data from then on;
- `seconds` pass (a consumer that never came: KV files are immutable, so a long hold
  serves stale data to nobody, but it holds fds and the file system's space);
- the budget needs room (`max_files`, `max_bytes` per worker): the oldest goes first,
  since a router's newest request is the most urgent.
A file held is warm: a second warm-up of it is answered `resident` without an open, and
`check` says so without opening it (an open there would be taken for the consumer's).
"""

from __future__ import annotations

import os
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvprefetchd.native import Native
from kvprefetchd.worker.closer import Closer

# How long a worker's exit waits for the file system to answer the closes of what it held.
CLOSE_WAIT_S = 5.0

# struct inotify_event: wd, mask, cookie, len, then len bytes of name (none for a file watch)
_EVENT = struct.Struct("iIII")
IN_OPEN = 0x20
IN_DELETE_SELF = 0x400
IN_IGNORED = 0x8000
RELEASES = ("opened", "expired", "budget", "deleted", "replaced", "evicted", "closed")


@dataclass(slots=True)
class Held:
    fd: int
    size: int
    until: float
    wd: int


class Holds:
    """One worker's held files, by key (root index, relative name)."""

    def __init__(self, native: Native, *, max_files: int, max_bytes: int, seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lib = native.lib
        self.max_files, self.max_bytes, self.seconds = max_files, max_bytes, seconds
        self._clock = clock
        self._held: OrderedDict[Hashable, Held] = OrderedDict()  # oldest first
        self._by_wd: dict[int, Hashable] = {}
        self._closer = Closer()  # every held fd is closed there: closer.py says why
        self.bytes = 0
        self.released: Counter[str] = Counter()  # why, since the last report
        self.held_total = 0  # files taken since the last report
        self.refused = 0  # files too large for the budget, since the last report
        watch = int(self._lib.kvp_watch_new()) if max_files else -1
        # Without inotify (EMFILE, a kernel without it) files are held for `seconds`.
        self._watch = watch if watch >= 0 else -1

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    def held(self, key: Hashable) -> Held | None:
        return self._held.get(key)

    @property
    def enabled(self) -> bool:
        return self.max_files > 0

    def fileno(self) -> int:
        """Readable when a held file was opened by someone else (-1: no inotify)."""
        return self._watch

    def hold(self, key: Hashable, fd: int, size: int) -> bool:
        """Keep `fd` (this object's now, closed by it in any case); False when it does not
        fit the budget at all (let go at once)."""
        if key in self._held:
            self.release(key, "replaced")
        if not self.enabled or size > self.max_bytes:
            self._closer.close(fd)
            self.refused += 1
            return False
        while self._held and (len(self._held) >= self.max_files
                              or self.bytes + size > self.max_bytes):
            self.release(next(iter(self._held)), "budget")
        wd = int(self._lib.kvp_watch_fd(self._watch, fd)) if self._watch >= 0 else -1
        if wd >= 0:
            self._by_wd[wd] = key
        self._held[key] = Held(fd, size, self._clock() + self.seconds, wd)
        self.bytes += size
        self.held_total += 1
        return True

    def release(self, key: Hashable, why: str) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        if held.wd >= 0 and self._by_wd.pop(held.wd, None) is not None and why != "opened":
            self._lib.kvp_watch_drop(self._watch, held.wd)  # one-shot: gone after an event
        self._closer.close(held.fd)
        self.bytes -= held.size
        self.released[why] += 1

    def read_events(self) -> None:
        """Let go of every held file someone else opened (or that was deleted)."""
        if self._watch < 0:
            return
        while True:
            try:
                data = os.read(self._watch, 65536)
            except (BlockingIOError, InterruptedError):
                return
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if mask & IN_IGNORED:
                    self._by_wd.pop(wd, None)
                    continue
                key = self._by_wd.pop(wd, None)
                if key is not None and self._held.get(key) is not None:
                    self._held[key].wd = -1  # the one-shot watch is gone already
                    self.release(key, "opened" if mask & IN_OPEN else "deleted")

    def expire(self) -> None:
        now = self._clock()
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.until > now:
                break
            self.release(key, "expired")

    def next_due(self) -> float | None:
        """Seconds until the oldest hold runs out; None when nothing is held."""
        if not self._held:
            return None
        return max(0.0, next(iter(self._held.values())).until - self._clock())

    def settled(self) -> None:
        """Until every fd let go so far is closed (closer.py closes them on its thread)."""
        self._closer.wait()

    def close(self) -> None:
        for key in list(self._held):
            self.release(key, "closed")
        self._closer.stop(CLOSE_WAIT_S)
        if self._watch >= 0:
            os.close(self._watch)
            self._watch = -1

    def report(self) -> dict[str, int]:
        """Counter deltas since the last report, and the gauges now."""
        figures = {f"hold_released_{why}": n for why, n in self.released.items() if n}
        if self.held_total:
            figures["held_total"] = self.held_total
        if self.refused:
            figures["hold_refused"] = self.refused
        self.released.clear()
        self.held_total = self.refused = 0
        return figures


@dataclass(frozen=True)
class HoldBudget:
    """One worker's share of the hold budget (config: hold_max_files, hold_max_bytes per
    daemon, split evenly: paths shard evenly across workers)."""

    max_files: int = 0
    max_bytes: int = 0
    seconds: float = 120.0
