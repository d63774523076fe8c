"""Which waiting file the queue starts next (native/schedule.c), through the real extension.

One thread (max_threads 1) is held on a read of the slow-tier simulator (a READ hang on
/gate/) while requests pile up behind it; once released, the one thread starts the rest
one at a time, so the order outcomes are reaped in is the order the scheduler chose:
clients take turns; a client's files with a deadline it can still meet go first, earliest
first; then the files without a deadline, the newest request first and each request's
files in their own order; then those too late to be read in time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from native_helpers import OUTCOMES, Batch, KiB, new_queue, open_root, write_file

from kvharness.fixtures import mount_tier
from kvprefetchd._native import ffi, lib

HOLD_S = 2.0  # the gate's read: the root's service time once it returns


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    """The simulator over gate/g and files/*, reads under /gate/ held until released."""
    backing = tmp_path / "backing"
    for name in ["gate/g", *(f"files/{c}{i}" for c in "abcdef" for i in range(3))]:
        (backing / name).parent.mkdir(parents=True, exist_ok=True)
        write_file(backing / name, 16 * KiB)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with mount_tier(backing, mountpoint) as tier:
        tier.hold("read", "/gate/")
        try:
            yield tier, mountpoint
        finally:
            tier.release()


class Queue:
    """One queue with one thread; names submitted by tag, outcomes in reaping order."""

    def __init__(self) -> None:
        self.queue = new_queue(initial_depth=1, max_threads=1)
        self.out = ffi.new("struct kvp_done[]", 64)
        self.batches: list[Batch] = []
        self.names: list[str] = []
        self.order: list[str] = []

    def submit(self, root_fd: int, rels: Sequence[str], *, group: int, client: int,
               deadline_ns: int = 0) -> None:
        batch = Batch(root_fd, rels, 4 * KiB)
        for item in batch.items[0:batch.n]:
            item.group, item.client, item.deadline_ns = group, client, deadline_ns
        self.batches.append(batch)
        tags = list(range(len(self.names), len(self.names) + batch.n))
        self.names.extend(rels)
        assert lib.kvp_queue_submit(self.queue, batch.items, ffi.new("uint64_t[]", tags),
                                    batch.n) == batch.n

    def hold_the_thread(self, root_fd: int, *, group: int, client: int) -> None:
        """Submit gate/g and wait until the one thread is in its held read."""
        self.submit(root_fd, ["gate/g"], group=group, client=client)
        deadline = time.monotonic() + 10
        while self.stats().running < 1:
            assert time.monotonic() < deadline, "the gate's read never started"
            time.sleep(0.01)

    def stats(self) -> Any:
        stats = ffi.new("struct kvp_queue_stats *")
        lib.kvp_queue_stats(self.queue, stats)
        return stats

    def reap_all(self, seconds: float = 30.0) -> list[str]:
        deadline = time.monotonic() + seconds
        while len(self.order) < len(self.names):
            assert time.monotonic() < deadline, f"settled only {self.order}"
            lib.kvp_queue_tick(self.queue)
            for k in range(lib.kvp_queue_reap(self.queue, self.out, 64)):
                done = self.out[k]
                assert OUTCOMES[done.outcome] == "READ", (self.names[done.tag], done.outcome)
                self.order.append(self.names[done.tag])
            time.sleep(0.01)
        return self.order


def files(letter: str) -> list[str]:
    return [f"files/{letter}{i}" for i in range(3)]


def test_clients_take_turns_deadlines_first_then_the_newest_request(
        gated: tuple[Any, Path]) -> None:
    tier, mountpoint = gated
    root_fd = open_root(mountpoint)
    try:
        queue = Queue()
        queue.hold_the_thread(root_fd, group=1, client=1)
        submitted = time.monotonic_ns()
        queue.submit(root_fd, files("a"), group=2, client=1)  # older, no deadline
        queue.submit(root_fd, files("b"), group=3, client=1)  # newer, no deadline
        queue.submit(root_fd, files("c"), group=4, client=2)  # another client
        queue.submit(root_fd, files("d")[:2], group=5, client=1,
                     deadline_ns=submitted + 40 * 10**9)
        queue.submit(root_fd, files("e")[:1], group=6, client=1,
                     deadline_ns=submitted + 30 * 10**9)
        tier.release()
        order = queue.reap_all()
    finally:
        os.close(root_fd)
    # Client 1 had the only turn when the gate was taken, so it is next again.
    assert order == ["gate/g",
                     "files/e0", "files/c0", "files/d0", "files/c1", "files/d1", "files/c2",
                     "files/b0", "files/b1", "files/b2", "files/a0", "files/a1", "files/a2"], order


def test_a_file_too_late_to_make_its_deadline_waits_for_those_that_can(
        gated: tuple[Any, Path]) -> None:
    """Once the gate's read returns, the root's service time is HOLD_S: a file due sooner
    than that cannot be read in time, so one due later goes first, and the files without a
    deadline too; then the late one, still read (its read shortens its consumer's)."""
    tier, mountpoint = gated
    root_fd = open_root(mountpoint)
    try:
        queue = Queue()
        queue.hold_the_thread(root_fd, group=1, client=1)
        submitted = time.monotonic_ns()
        queue.submit(root_fd, files("b"), group=2, client=1)
        queue.submit(root_fd, files("f")[:1], group=3, client=1,
                     deadline_ns=submitted + int((HOLD_S + 1.0) * 1e9))
        queue.submit(root_fd, files("e")[:1], group=4, client=1,
                     deadline_ns=submitted + 30 * 10**9)
        time.sleep(HOLD_S)
        tier.release()
        order = queue.reap_all()
    finally:
        os.close(root_fd)
    assert order == ["gate/g", "files/e0", *files("b"), "files/f0"], order


def test_without_groups_or_clients_the_queue_is_first_come_first_served(
        gated: tuple[Any, Path]) -> None:
    """A caller that names no request (group 0) gets the order it submitted in."""
    tier, mountpoint = gated
    root_fd = open_root(mountpoint)
    try:
        queue = Queue()
        queue.hold_the_thread(root_fd, group=0, client=0)
        for letter in "abc":
            queue.submit(root_fd, files(letter), group=0, client=0)
        tier.release()
        order = queue.reap_all()
    finally:
        os.close(root_fd)
    assert order == ["gate/g", *files("a"), *files("b"), *files("c")], order


def test_a_request_that_cannot_make_its_deadline_is_not_read_one_that_can_is_read_in_full(
        gated: tuple[Any, Path]) -> None:
    """Judged on arrival against the root's read time (HOLD_S, from the gate's read): a
    request due sooner settles EXPIRED at once, unread; one due later starts all its files
    at once, past the root's depth, while a file without a deadline waits for it. Each
    file by its place: in a request due as soon, numbered, the first expires, but its
    consumer, fetching it itself (the tier's fastest fetch: HOLD_S too), reaches the
    second and third late enough for a read: those are read."""
    tier, mountpoint = gated
    root_fd = open_root(mountpoint)
    queue = new_queue(initial_depth=1, max_threads=8)
    depth = 0
    out = ffi.new("struct kvp_done[]", 64)
    names: list[str] = []
    settled: dict[str, tuple[str, int]] = {}
    batches: list[Batch] = []

    def submit(rels: Sequence[str], group: int, deadline_ns: int = 0,
               numbered: bool = False) -> None:
        batch = Batch(root_fd, rels, 4 * KiB)
        for position, item in enumerate(batch.items[0:batch.n]):
            item.group, item.client, item.deadline_ns = group, 1, deadline_ns
            item.position = position if numbered else 0
        batches.append(batch)
        tags = ffi.new("uint64_t[]", list(range(len(names), len(names) + batch.n)))
        names.extend(rels)
        assert lib.kvp_queue_submit(queue, batch.items, tags, batch.n) == batch.n

    def reap(tick: bool = True) -> None:
        if tick:
            lib.kvp_queue_tick(queue)
        for k in range(lib.kvp_queue_reap(queue, out, 64)):
            settled[names[out[k].tag]] = (OUTCOMES[out[k].outcome], out[k].done)

    def stats() -> Any:
        figures = ffi.new("struct kvp_queue_stats *")
        lib.kvp_queue_stats(queue, figures)
        return figures

    def until(check: Any, what: str) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, (what, settled, stats().running)
            reap()
            time.sleep(0.01)

    try:
        submit(["gate/g"], group=1)  # the gate's read sets the root's read time: HOLD_S
        until(lambda: stats().running == 1, "the gate's read started")
        time.sleep(HOLD_S)
        tier.release()
        until(lambda: "gate/g" in settled, "the gate's read returned")
        assert stats().root_rtt_us[0] >= HOLD_S * 0.9e6
        depth = stats().root_depth[0]  # its least: MIN_DEPTH (depthctl.c)
        assert 1 <= depth <= 3
        tier.hold("read", "/files/")
        submit(files("a")[:depth], group=2)  # reads out, as many as the depth: not idle
        until(lambda: stats().running == depth, "a's reads started")
        now = time.monotonic_ns()
        submit(files("c"), group=3, deadline_ns=now + int(HOLD_S / 2 * 1e9))
        reap(tick=False)  # settled by the submit itself, not by a sweep
        assert {name: settled.get(name) for name in files("c")} == {
            name: ("EXPIRED", 0) for name in files("c")}
        submit(files("e"), group=6, deadline_ns=now + int(HOLD_S / 2 * 1e9), numbered=True)
        reap(tick=False)
        assert {name: settled.get(name) for name in files("e")} == {
            "files/e0": ("EXPIRED", 0), "files/e1": None, "files/e2": None}
        submit(files("b"), group=4, deadline_ns=now + 60 * 10**9)
        submit(["files/d0"], group=5)  # no deadline: held by the depth
        until(lambda: stats().running == depth + 5, "b's and e's reads started past the depth")
        assert stats().root_depth[0] == depth and stats().pending == 1
        tier.release()
        until(lambda: len(settled) == len(names), "everything settled")
    finally:
        tier.release()
        os.close(root_fd)
    read = [*files("a")[:depth], *files("b"), *files("e")[1:], "files/d0"]
    assert {name: settled[name][0] for name in read} == dict.fromkeys(read, "READ")
