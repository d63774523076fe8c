"""The heartbeat with the OS patched: who counts as wedged, what killing one settles, batch bounds.

The real thing (a worker really hung, really killed) is tests/integration/test_faults.py;
here the pool's judgement is checked without processes or clocks.
"""

from __future__ import annotations

import selectors
import signal
import socket
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprefetchd import faults
from kvprefetchd.channel import ChannelReader, Done, Share
from kvprefetchd.config import build_config
from kvprefetchd.engines import PREAD, WarmEngines
from kvprefetchd.engines.base import MAX_BATCH_BYTES, EngineSettings, WarmItem, next_batch
from kvprefetchd.metrics.histogram import FILE_BUCKETS, Histogram
from kvprefetchd.roots.rootset import RootSet
from kvprefetchd.roots.scout import Scout
from kvprefetchd.supervisor.books import Books, Waiter
from kvprefetchd.supervisor.handle import WorkerHandle
from kvprefetchd.supervisor.pool import WorkerPool
from kvprefetchd.supervisor.stuck import Stuck
from kvprefetchd.worker.loop import Worker
from kvprefetchd.worker.plan import WorkerPlan

MIB = 1 << 20
TIMEOUT = 5.0


class Patched:
    """A pool whose two workers are socketpairs, with os.kill and spawning recorded."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        config = build_config(
            {"roots": [str(tmp_path)], "workers": 2, "worker_timeout": TIMEOUT}, {}
        )
        self.books = Books(2)
        self.selector = selectors.DefaultSelector()
        self.stuck = Stuck()
        roots = RootSet(config, Scout(self.selector, self.stuck, 1.0), lambda state: None)
        self.pool = WorkerPool(config, roots, self.books, self.selector, self.stuck)
        self.kills: list[tuple[int, int]] = []
        self.spawned: list[int] = []
        self.peers: list[socket.socket] = []
        monkeypatch.setattr("kvprefetchd.supervisor.pool.os.kill", self._kill)
        monkeypatch.setattr(self.pool, "spawn", self.spawned.append)
        for index in range(2):
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            self.peers.append(theirs)
            handle = WorkerHandle(index, 90_000 + index, ours, ChannelReader(ours), ready=True)
            self.pool.workers[index] = handle
            self.selector.register(ours, selectors.EVENT_READ, None)

    def _kill(self, pid: int, signum: int) -> None:
        self.kills.append((pid, signum))

    def handle(self, index: int) -> WorkerHandle:
        handle = self.pool.workers[index]
        assert handle is not None
        return handle

    def issue(self, worker: int, waiter: Waiter | None, files: int) -> None:
        self.books.issue(worker, waiter, Share.of([0] * files,
                                                  [f"{i}.bin".encode() for i in range(files)]))

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.selector.close()


@pytest.fixture
def patched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Patched]:
    instance = Patched(tmp_path, monkeypatch)
    yield instance
    instance.close()


def test_a_silent_worker_that_owes_outcomes_is_killed_failed_and_replaced(
    patched: Patched,
) -> None:
    pool, now = patched.pool, time.monotonic()
    waiter = Waiter(1, now, None)
    patched.issue(0, waiter, 3)
    patched.issue(0, None, 2)
    patched.handle(0).heard = now - TIMEOUT - 1
    patched.handle(1).heard = now - 10 * TIMEOUT  # idle: owes nothing, however long ago

    pool.murder_workers(now)

    assert patched.kills == [(90_000, signal.SIGKILL)]
    assert patched.spawned == [0]
    assert (pool.killed_wedged, pool.restarts) == (1, 1)
    # The pool answers no one: it hands the complete waiter to the supervisor's loop.
    assert pool.take_complete() == [waiter] and waiter.outcome_map()["failed"] == 3
    # Its exit is not waited for: it is tracked until reaped (it may be stuck in the kernel).
    assert [child["pid"] for child in patched.stuck.report()] == [90_000]
    assert not waiter.answered
    assert patched.books.totals["failed"] == 5 and patched.books.outstanding(0) == 0


def test_a_worker_heard_from_within_the_timeout_is_left_alone(patched: Patched) -> None:
    pool, now = patched.pool, time.monotonic()
    patched.issue(0, None, 1)
    patched.handle(0).heard = now - 2.0
    pool.murder_workers(now)
    assert patched.kills == [] and pool.killed_wedged == 0
    # The loop sleeps until that worker could first be wedged, not longer.
    assert pool.wedge_check_due == pytest.approx(now - 2.0 + TIMEOUT)
    assert pool.next_due(now) == pytest.approx(TIMEOUT - 2.0)


def test_a_report_restarts_the_clock(patched: Patched) -> None:
    pool, now = patched.pool, time.monotonic()
    patched.issue(0, None, 1)
    patched.handle(0).heard = now - 2 * TIMEOUT
    report = Done(unfollowed={"read": 1}, latency_counts=Histogram(FILE_BUCKETS).counts)
    pool.on_messages(patched.handle(0), [report])
    patched.issue(0, None, 1)
    pool.murder_workers(time.monotonic())
    assert patched.kills == []


def test_work_handed_to_an_idle_worker_starts_its_clock_but_more_work_does_not(
    patched: Patched,
) -> None:
    pool, long_ago = patched.pool, time.monotonic() - 2 * TIMEOUT
    patched.handle(0).heard = long_ago  # idle since long ago
    patched.issue(1, None, 1)  # busy, last heard a while ago
    patched.handle(1).heard = long_ago + TIMEOUT
    shares: list[Share | None] = [Share.of([0], [b"a.bin"]), Share.of([0], [b"b.bin"])]
    pool.dispatch(shares, None, MIB, "read")
    assert patched.books.outstanding(0) == 1 and patched.books.outstanding(1) == 2
    assert patched.handle(0).heard > long_ago + TIMEOUT
    assert patched.handle(1).heard == long_ago + TIMEOUT
    pool.murder_workers(long_ago + 2 * TIMEOUT + 0.5)
    assert patched.kills == [(90_001, signal.SIGKILL)]


@pytest.mark.parametrize(
    ("heads", "batches"),
    [
        ([64 * MIB] * 10, [4, 4, 2]),  # large heads: fewer files per batch
        ([1 * MIB] * 300, [256, 44]),  # the defaults: batch_files binds, as before
        ([MAX_BATCH_BYTES * 2, MIB], [1, 1]),  # a head larger than the budget goes alone
    ],
)
def test_a_batch_holds_at_most_batch_files_and_max_batch_bytes(
    heads: list[int], batches: list[int]
) -> None:
    pending = deque(
        WarmItem(0, 0, f"{i}.bin".encode(), head, (0, f"{i}.bin".encode()))
        for i, head in enumerate(heads)
    )
    taken = []
    while pending:
        taken.append(len(next_batch(pending, 256)))
    assert taken == batches


def test_fault_arguments_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPREFETCHD_FAULTS", raising=False)
    assert faults.BatchFaults.from_environment() is None
    monkeypatch.setenv("KVPREFETCHD_FAULTS", "worker_boot_fails, worker_hang_on=/x y")
    assert faults.injected(faults.WORKER_BOOT_FAILS)
    assert faults.argument(faults.WORKER_HANG_ON) == "/x y"
    assert faults.argument(faults.WORKER_BATCH_SLEEP) is None
    batch = faults.BatchFaults.from_environment()
    assert batch is not None and batch.hang_on == b"/x y" and batch.sleep_seconds == 0.0
    batch.apply([b"a/b.bin"])  # no match: returns at once
    monkeypatch.setenv("KVPREFETCHD_FAULTS", "worker_batch_sleep=0.01")
    slow = faults.BatchFaults.from_environment()
    assert slow is not None and slow.hang_on is None and slow.sleep_seconds == 0.01


def test_no_fault_is_read_when_none_is_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVPREFETCHD_FAULTS", raising=False)
    settings = EngineSettings(128 * 1024, 128, 16, True, 256, 1024)
    engines = WarmEngines({"read": (PREAD,)}, "read", settings, "test")
    ours, theirs = socket.socketpair()
    plan = WorkerPlan(0, (str(tmp_path),), (-1,), (0,), {"read": (PREAD,)}, settings, 1.0, 100)
    worker = Worker(plan, ours, engines)
    assert worker.faults is None
    ours.close()
    theirs.close()
