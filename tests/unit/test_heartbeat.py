"""The heartbeat with the OS patched: who counts as wedged, what killing one settles, batch bounds.

The real thing (a worker really hung, really killed) is tests/integration/test_faults.py;
here the supervisor's judgement is checked without processes or clocks.
"""

from __future__ import annotations

import signal
import socket
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from kvprefetchd import faults
from kvprefetchd.books import PendingRequest
from kvprefetchd.channel import ChannelReader
from kvprefetchd.config import build_config
from kvprefetchd.engines.base import Completion, EngineSettings, QueueAnswer, WarmItem
from kvprefetchd.metrics import FILE_BUCKETS, Histogram
from kvprefetchd.server import Connection
from kvprefetchd.supervisor import Supervisor, WorkerHandle
from kvprefetchd.worker import MAX_BATCH_BYTES, Worker, WorkerPlan

MIB = 1 << 20
TIMEOUT = 5.0


class Patched:
    """A supervisor whose two workers are socketpairs, with os.kill and spawning recorded."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        config = build_config(
            {"roots": [str(tmp_path)], "workers": 2, "worker_timeout": TIMEOUT}, {}
        )
        self.sup = Supervisor(config)
        self.kills: list[tuple[int, int]] = []
        self.spawned: list[int] = []
        self.peers: list[socket.socket] = []
        monkeypatch.setattr("kvprefetchd.supervisor.os.kill", self._kill)
        monkeypatch.setattr(self.sup, "spawn_worker", self.spawned.append)
        for index in range(2):
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            self.peers.append(theirs)
            handle = WorkerHandle(index, 90_000 + index, ours, ChannelReader(ours), ready=True)
            self.sup.workers[index] = handle
            self.sup.selector.register(ours, 1, handle)

    def _kill(self, pid: int, signum: int) -> None:
        self.kills.append((pid, signum))

    def handle(self, index: int) -> WorkerHandle:
        handle = self.sup.workers[index]
        assert handle is not None
        return handle

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


@pytest.fixture
def patched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Patched]:
    instance = Patched(tmp_path, monkeypatch)
    yield instance
    instance.close()


def test_a_silent_worker_that_owes_outcomes_is_killed_failed_and_replaced(
    patched: Patched,
) -> None:
    sup, now = patched.sup, time.monotonic()
    replies: list[PendingRequest] = []
    request = PendingRequest(1, replies.append, now, None)
    for _ in range(3):
        sup.books.issue(0, request)
    sup.books.issue_anonymous(0, 2)
    patched.handle(0).heard = now - TIMEOUT - 1
    patched.handle(1).heard = now - 10 * TIMEOUT  # idle: owes nothing, however long ago

    sup.murder_workers(now)

    assert patched.kills == [(90_000, signal.SIGKILL)]
    assert patched.spawned == [0]
    assert (sup.workers_killed_wedged, sup.worker_restarts) == (1, 1)
    assert replies == [request] and request.outcome_map()["failed"] == 3
    assert sup.books.totals["failed"] == 5 and sup.books.outstanding(0) == 0
    assert sup.stats()["workers_killed_wedged"] == 1


def test_a_worker_heard_from_within_the_timeout_is_left_alone(patched: Patched) -> None:
    sup, now = patched.sup, time.monotonic()
    sup.books.issue_anonymous(0, 1)
    patched.handle(0).heard = now - 2.0
    sup.murder_workers(now)
    assert patched.kills == [] and sup.workers_killed_wedged == 0
    # The loop sleeps until that worker could first be wedged, not longer.
    assert sup.wedge_check_due == pytest.approx(now - 2.0 + TIMEOUT)
    assert sup.stats()["workers"][0]["silent_s"] >= 2.0
    assert sup.stats()["workers"][1]["silent_s"] == 0.0


def test_a_report_restarts_the_clock(patched: Patched) -> None:
    sup, now = patched.sup, time.monotonic()
    sup.books.issue_anonymous(0, 1)
    patched.handle(0).heard = now - 2 * TIMEOUT
    latency = Histogram(FILE_BUCKETS)
    report = ["done", [], {}, {"read": 1}, 0, [latency.counts, latency.sum]]
    sup.on_worker_messages(patched.handle(0), [report])
    sup.books.issue_anonymous(0, 1)
    sup.murder_workers(time.monotonic())
    assert patched.kills == []


def test_work_handed_to_an_idle_worker_starts_its_clock_but_more_work_does_not(
    patched: Patched, tmp_path: Path
) -> None:
    sup, long_ago = patched.sup, time.monotonic() - 2 * TIMEOUT
    patched.handle(0).heard = long_ago  # idle since long ago
    sup.books.issue_anonymous(1, 1)  # busy, last heard a while ago
    patched.handle(1).heard = long_ago + TIMEOUT
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    connection = Connection(ours, 1 << 20, 1 << 20)
    paths = [str(tmp_path / f"{i}.bin") for i in range(40)]
    payload = msgpack.packb({"v": 1, "id": 1, "op": "prefetch", "paths": paths})
    sup.handle_frame(connection, payload)
    assert sup.books.outstanding(0) > 0 and sup.books.outstanding(1) > 1  # both got files
    assert patched.handle(0).heard > long_ago + TIMEOUT
    assert patched.handle(1).heard == long_ago + TIMEOUT
    sup.murder_workers(long_ago + 2 * TIMEOUT + 0.5)
    assert patched.kills == [(90_001, signal.SIGKILL)]
    ours.close()
    theirs.close()


class RecordingEngine:
    """An engine that reads nothing and remembers the size of each batch it was handed."""

    name = "recording"

    def __init__(self, batch_files: int) -> None:
        self.batch_files = batch_files
        self.queued: list[WarmItem] = []
        self.done: list[Completion] = []
        self.batches: list[int] = []

    def queue(self, item: WarmItem) -> QueueAnswer:
        if len(self.queued) >= self.batch_files:
            return QueueAnswer.BUSY
        self.queued.append(item)
        return QueueAnswer.QUEUED

    def submit(self) -> int:
        self.batches.append(len(self.queued))
        self.done += [
            Completion(item, "read", 0, item.read_bytes, item.read_bytes) for item in self.queued
        ]
        self.queued = []
        return self.batches[-1]

    def reap(self) -> list[Completion]:
        done, self.done = self.done, []
        return done


@pytest.mark.parametrize(
    ("wants", "batches"),
    [
        ([64 * MIB] * 10, [4, 4, 2]),  # large heads: fewer files per batch
        ([1 * MIB] * 300, [256, 44]),  # the defaults: batch_files binds, as before
        ([MAX_BATCH_BYTES * 2, MIB], [1, 1]),  # a head larger than the budget goes alone
    ],
)
def test_a_batch_holds_at_most_batch_files_and_max_batch_bytes(
    tmp_path: Path, wants: list[int], batches: list[int]
) -> None:
    settings = EngineSettings(128 * 1024, 128, 16, True, 256, 1024)
    plan = WorkerPlan(0, (str(tmp_path),), (0,), (), settings, 1.0, 100)
    engine = RecordingEngine(settings.batch_files)
    ours, theirs = socket.socketpair()
    worker = Worker(plan, ours, engine)  # type: ignore[arg-type]
    pending = deque(
        WarmItem(0, 0, f"{i}.bin".encode(), want, (0, f"{i}.bin".encode()))
        for i, want in enumerate(wants)
    )
    while pending:
        worker.warm_one_batch(worker.engine, pending)
    assert engine.batches == batches
    ours.close()
    theirs.close()


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
    ours, theirs = socket.socketpair()
    worker = Worker(WorkerPlan(0, (str(tmp_path),), (0,), (), settings, 1.0, 100), ours,
                    RecordingEngine(1))  # type: ignore[arg-type]
    assert worker.faults is None
    ours.close()
    theirs.close()
