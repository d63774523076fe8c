"""Admission by the tier's own count (native/gauge.c, schedule.c), through the real extension.

The slow-tier simulator with 2 fetch slots of 100 ms answers 20 fetches a second. The
queue learns that rate from its own reads; then other readers (a consumer's threads)
fill the tier's queue, which only the FUSE connection's `waiting` shows: the root's own
reads say nothing of it. A request due before the tier could answer it is refused whole:
its files stand by, unread while every slot of the tier is busy, read if one frees before
their consumer could get to them, else settled EXPIRED unread. Once the tier's queue has
drained, the same request goes whole.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from native_helpers import OUTCOMES, Batch, KiB, new_queue, open_root, write_file

from kvharness.fixtures import mount_tier
from kvharness.realtier import fuse_connection
from kvprefetchd._native import ffi, lib

SLOTS, LATENCY_MS = 2, 100  # the tier answers SLOTS / latency = 20 fetches a second
RATE = SLOTS * 1000 / LATENCY_MS


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The simulator over learn/*, others/*, late/* and later/* (all cold), and its
    fusectl directory (skipped where fusectl cannot be read: not root)."""
    backing = tmp_path / "backing"
    for group, count in (("learn", 8), ("others", 32), ("late", 3), ("freed", 3), ("later", 3)):
        (backing / group).mkdir(parents=True)
        for i in range(count):
            write_file(backing / group / f"{i}", 16 * KiB, seed=i)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with mount_tier(backing, mountpoint, latency_ms=LATENCY_MS, slots=SLOTS):
        connection = fuse_connection(mountpoint)
        if not (connection / "waiting").exists():
            pytest.skip(f"fusectl cannot be read here ({connection})")
        yield mountpoint, connection


class Queue:
    def __init__(self, root_fd: int) -> None:
        self.queue = new_queue(initial_depth=16, max_threads=16)
        self.root_fd = root_fd
        self.out = ffi.new("struct kvp_done[]", 64)
        self.batches: list[Batch] = []
        self.names: list[str] = []
        self.settled: dict[str, str] = {}

    def submit(self, rels: Sequence[str], *, group: int, lead_s: float) -> None:
        batch = Batch(self.root_fd, rels, 16 * KiB)
        deadline = time.monotonic_ns() + int(lead_s * 1e9)
        for position, item in enumerate(batch.items[0:batch.n]):
            item.group, item.client, item.deadline_ns, item.position = group, 1, deadline, position
        self.batches.append(batch)
        tags = ffi.new("uint64_t[]", list(range(len(self.names), len(self.names) + batch.n)))
        self.names.extend(rels)
        assert lib.kvp_queue_submit(self.queue, batch.items, tags, batch.n) == batch.n

    def reap(self) -> dict[str, str]:
        for k in range(lib.kvp_queue_reap(self.queue, self.out, 64)):
            self.settled[self.names[self.out[k].tag]] = OUTCOMES[self.out[k].outcome]
        return self.settled

    def stats(self) -> Any:
        figures = ffi.new("struct kvp_queue_stats *")
        lib.kvp_queue_stats(self.queue, figures)
        return figures

    def settle(self, rels: Sequence[str], seconds: float = 30.0) -> dict[str, str]:
        deadline = time.monotonic() + seconds
        while not all(rel in self.reap() for rel in rels):
            assert time.monotonic() < deadline, self.settled
            lib.kvp_queue_tick(self.queue)  # the worker's loop ticks its queue (standby, sweep)
            time.sleep(0.01)
        return {rel: self.settled[rel] for rel in rels}


def waiting(connection: Path) -> int:
    return int((connection / "waiting").read_text())


def test_a_root_without_a_count_has_no_gauge(tmp_path: Path) -> None:
    root_fd = open_root(tmp_path)
    try:
        queue = new_queue()
        assert lib.kvp_queue_root_gauge(queue, root_fd, str(tmp_path).encode()) == -errno.ENOENT
        assert lib.kvp_queue_root_gauge(queue, root_fd, b"/nonexistent/fusectl") == -errno.ENOENT
    finally:
        os.close(root_fd)


def consume(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 4096, 0)
    finally:
        os.close(fd)


def fill(mountpoint: Path, connection: Path, rels: Sequence[str]) -> list[threading.Thread]:
    """Other readers' fetches, every one in the tier's queue when this returns."""
    readers = [threading.Thread(target=consume, args=(mountpoint / rel,)) for rel in rels]
    for reader in readers:
        reader.start()
    until = time.monotonic() + 10
    while waiting(connection) < len(rels):
        assert time.monotonic() < until, "the consumers' reads never queued"
        time.sleep(0.002)
    return readers


def drain(connection: Path, readers: list[threading.Thread]) -> None:
    for reader in readers:
        reader.join()
    until = time.monotonic() + 10
    while waiting(connection) > 0:
        assert time.monotonic() < until, "the tier's queue never drained"
        time.sleep(0.005)


def test_a_request_the_tiers_queue_would_make_late_stands_by(tier: tuple[Path, Path]) -> None:
    mountpoint, connection = tier
    root_fd = open_root(mountpoint)
    queue = Queue(root_fd)
    readers: list[threading.Thread] = []
    try:
        assert lib.kvp_queue_root_gauge(queue.queue, root_fd, str(connection).encode()) == 0

        # Its own reads teach the gauge the tier's rate: 8 fetches on 2 slots queue.
        learn = [f"learn/{i}" for i in range(8)]
        queue.submit(learn, group=1, lead_s=30)
        assert queue.settle(learn) == dict.fromkeys(learn, "READ")
        rate = queue.stats().root_served[0]
        assert RATE * 0.6 <= rate <= RATE * 1.5, rate

        # Other readers fill the tier's queue with 24 fetches: 1.2 s of its work. A request
        # due in 0.3 s is refused whole; its files stand by, unread while every slot is
        # busy, and are settled EXPIRED by the time their consumer has them (0.4-0.6 s).
        readers = fill(mountpoint, connection, [f"others/{i}" for i in range(24)])
        late = [f"late/{i}" for i in range(3)]
        queue.submit(late, group=2, lead_s=0.3)
        assert queue.reap() == queue.settled and not set(late) & set(queue.settled)
        assert queue.stats().pending == len(late)
        assert queue.settle(late) == dict.fromkeys(late, "EXPIRED")
        assert queue.stats().standby_reads == 0 and queue.stats().pending == 0
        drain(connection, readers)

        # 8 fetches (0.4 s of work): a request due just before the tier could answer all
        # of it (by the rate learned) is refused whole too, but the tier frees its slots
        # before the consumer gets to the files (0.1-0.3 s after the deadline): read then.
        # No read has taught the rate for over a second, so the first file goes at once
        # to teach it (schedule.c's probe); the other two stand by.
        readers = fill(mountpoint, connection, [f"others/{i}" for i in range(24, 32)])
        freed = [f"freed/{i}" for i in range(3)]
        queue.submit(freed, group=3, lead_s=(8 + len(freed)) / rate - 0.05)
        assert not set(freed) & set(queue.reap())
        assert queue.settle(freed) == dict.fromkeys(freed, "READ")
        assert queue.stats().standby_reads == len(freed) - 1
        drain(connection, readers)

        # The same lead on an idle tier: 3 fetches on 2 slots are back in 0.2 s. Whole.
        later = [f"later/{i}" for i in range(3)]
        queue.submit(later, group=4, lead_s=0.3)
        assert queue.settle(later) == dict.fromkeys(later, "READ")
        assert queue.stats().standby_reads == len(freed) - 1
    finally:
        for reader in readers:
            reader.join()
        os.close(root_fd)
