"""Admission by the tier's own count (native/gauge.c, schedule.c), through the real extension.

The slow-tier simulator with 2 fetch slots of 100 ms answers 20 fetches a second. The
queue learns that rate from its own reads; then other readers (a consumer's threads)
fill the tier's queue, which only the FUSE connection's `waiting` shows: the root's own
reads say nothing of it. A request due before the tier could answer it is refused whole
at once, unread; once the tier's queue has drained, the same request goes whole.
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
    for group, count in (("learn", 8), ("others", 12), ("late", 3), ("later", 3)):
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


def test_a_request_the_tiers_queue_would_make_late_is_refused_whole(
        tier: tuple[Path, Path]) -> None:
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
        served = queue.stats().root_served[0]
        assert RATE * 0.6 <= served <= RATE * 1.5, served

        # Other readers fill the tier's queue: 12 fetches, 0.6 s of the tier's work.
        def consume(rel: str) -> None:
            fd = os.open(mountpoint / rel, os.O_RDONLY)
            try:
                os.pread(fd, 4096, 0)
            finally:
                os.close(fd)

        readers = [threading.Thread(target=consume, args=(f"others/{i}",)) for i in range(12)]
        for reader in readers:
            reader.start()
        until = time.monotonic() + 10
        while waiting(connection) < 8:
            assert time.monotonic() < until, "the consumers' reads never queued"
            time.sleep(0.005)

        # Due in 0.3 s: the tier's queue alone is longer. Refused whole, unread, at once.
        late = [f"late/{i}" for i in range(3)]
        queue.submit(late, group=2, lead_s=0.3)
        assert {rel: queue.reap().get(rel) for rel in late} == dict.fromkeys(late, "EXPIRED")

        for reader in readers:
            reader.join()
        until = time.monotonic() + 10
        while waiting(connection) > 0:
            assert time.monotonic() < until, "the tier's queue never drained"
            time.sleep(0.005)

        # The same lead on an idle tier: 3 fetches on 2 slots are back in 0.2 s. Whole.
        later = [f"later/{i}" for i in range(3)]
        queue.submit(later, group=3, lead_s=0.3)
        assert queue.settle(later) == dict.fromkeys(later, "READ")
    finally:
        for reader in readers:
            reader.join()
        os.close(root_fd)
