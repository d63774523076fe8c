"""The asynchronous engine: files go in as they arrive, outcomes come out as they finish.

One native queue (native/queue.c) per worker and warm mode, running a queue engine of
C's table (pread, or fadvise then a confirming read, per file), with persistent threads
whose reads in flight follow each root's file system (native/depthctl.c): a slow
tier gets hundreds of fetches in flight, a local disk as many as it serves faster
with; files behind another mount beneath their root have a lane of a few threads. The
worker polls `fileno()` beside its channel, reaps what finished, and ticks the queue while
files are out (stalled reads stop holding depth, late files fail).
"""

from __future__ import annotations

import errno
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvprefetchd.engines.base import (
    Completion,
    EngineSettings,
    NativeEngine,
    WarmItem,
    native_batch,
    strerror,
)
from kvprefetchd.native import NativeUnavailable

REAP_AT_ONCE = 4096  # outcomes moved per native call; more are left for the next


@dataclass(frozen=True)
class QueueFigures:
    """What the queue says of itself, for the worker's stats."""

    threads: int
    pending: int
    running: int
    stalled: int
    timed_out: int
    # root fd -> (reads in flight allowed, service time us, requests a second its tier
    # answers as its gauge learned: 0 none, native/gauge.c)
    depth: dict[int, tuple[int, int, int]]
    # The lane for files behind another mount beneath their root (native/queue.c): its
    # threads, those stuck (reading past its stall time), and the files it refused
    # because every thread was stuck.
    other_mount_threads: int = 0
    other_mount_stuck: int = 0
    other_mount_refused: int = 0
    # Files refused on arrival and read later, into a slot their tier had free before
    # their consumer could get to them (native/schedule.c's standby).
    standby_reads: int = 0


class QueueEngine(NativeEngine):
    """A native queue: `take` hands it files, `reap` collects their outcomes."""

    batched = False  # files are taken as they come, not a batch at a time

    def __init__(self, name: str, warm_mode: str, settings: EngineSettings) -> None:
        super().__init__(name, warm_mode, settings)
        ffi, lib = self._native.ffi, self._native.lib
        engine, mode = ffi.new("char[]", name.encode()), ffi.new("char[]", warm_mode.encode())
        config = ffi.new("struct kvp_queue_config *")
        config.engine = engine  # a queue engine of C's table; the queue keeps the table's copy
        config.warm_mode = mode
        config.fadv_random = int(settings.fadv_random)
        config.chunk = settings.chunk_bytes
        config.initial_depth = settings.initial_depth
        config.max_threads = settings.max_in_flight
        config.timeout_ns = int(settings.file_timeout * 1e9)
        config.other_mount_threads = settings.other_mount_threads
        error = ffi.new("int *")
        queue = lib.kvp_queue_new(config, error)
        if queue == ffi.NULL:
            raise NativeUnavailable(f"{name}: cannot set up its queue ({strerror(error[0])})")
        self._queue = ffi.gc(queue, lib.kvp_queue_free)
        self._out = ffi.new("struct kvp_done[]", REAP_AT_ONCE)
        self._items: dict[int, WarmItem] = {}  # tag -> what was submitted
        self._next_tag = 1
        self._refused: list[Completion] = []  # files the queue could not take

    def fileno(self) -> int:
        """Readable while outcomes wait to be reaped."""
        return int(self._native.lib.kvp_queue_fd(self._queue))

    @property
    def outstanding(self) -> int:
        return len(self._items) + len(self._refused)

    def take(self, pending: deque[WarmItem]) -> None:
        """Submit every pending file (the supervisor's queue_limit bounds how many)."""
        if not pending:
            return
        ffi, lib = self._native.ffi, self._native.lib
        items = list(pending)
        pending.clear()
        native, keep = native_batch(ffi, items)  # the queue copies what it keeps
        first = self._next_tag
        self._next_tag += len(items)
        tags = ffi.new("uint64_t[]", list(range(first, self._next_tag)))
        taken = lib.kvp_queue_submit(self._queue, native, tags, len(items))
        del keep
        for offset, item in enumerate(items[:taken]):
            self._items[first + offset] = item
        # Out of memory: what the queue could not take fails now, not later.
        self._refused.extend(Completion(item, "failed", errno.ENOMEM, 0, 0)
                             for item in items[taken:])

    def reap(self) -> list[Completion]:
        lib = self._native.lib
        done, self._refused = self._refused, []
        names, items, out = self._outcome_names, self._items, self._out
        while True:
            n = lib.kvp_queue_reap(self._queue, out, REAP_AT_ONCE)
            for index in range(n):
                record = out[index]
                item = items.pop(record.tag)
                done.append(Completion(item, names[record.outcome], record.err, record.size,
                                       record.done, record.fd))
            if n < REAP_AT_ONCE:
                return done

    def root_depth(self, root_fd: int, initial: int) -> None:
        """The reads in flight root_fd starts from (native kvp_queue_root_depth)."""
        self._native.lib.kvp_queue_root_depth(self._queue, root_fd, initial)

    def root_gauge(self, root_fd: int, connection: str) -> int:
        """Judge root_fd's requests by its FUSE connection's count of requests not
        answered (native kvp_queue_root_gauge): 0, or the errno that kept it from being
        read."""
        return -int(self._native.lib.kvp_queue_root_gauge(self._queue, root_fd,
                                                          os.fsencode(connection)))

    def tick(self) -> None:
        self._native.lib.kvp_queue_tick(self._queue)

    def figures(self) -> QueueFigures:
        ffi, lib = self._native.ffi, self._native.lib
        stats: Any = ffi.new("struct kvp_queue_stats *")
        lib.kvp_queue_stats(self._queue, stats)
        depth = {int(stats.root_fd[i]): (int(stats.root_depth[i]), int(stats.root_rtt_us[i]),
                                         int(stats.root_served[i]))
                 for i in range(stats.nroots)}
        return QueueFigures(int(stats.threads), int(stats.pending), int(stats.running),
                            int(stats.stalled), int(stats.timed_out), depth,
                            int(stats.mount_threads), int(stats.mount_stalled),
                            int(stats.mount_refused), int(stats.standby_reads))
