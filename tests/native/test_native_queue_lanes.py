"""The queue's other-mount lane (native/queue.c), through the real extension and real mounts.

A root's lane resolves on the root's own mount only; a name behind another mount beneath
the root moves to a lane of its own, read across mounts by at most other_mount_threads
threads. Issue 23: with one FIFO per root, names under a hung FUSE mount queued ahead of
the root's own files and took a thread each as the one before stalled, so the root's own
files waited for ever and stuck threads piled up.
"""

from __future__ import annotations

import errno
import os
import select
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from native_helpers import OUTCOMES, Batch, KiB, new_queue, write_file

from kvprefetchd._native import ffi, lib

STALL_SECONDS = 2.0  # the lane's stall time before it has timed a read (depthctl.c)


class Lanes:
    """A queue, the files submitted to it by tag, and their outcomes as reaped."""

    def __init__(self, **config: int) -> None:
        self.queue = new_queue(**config)
        self.out = ffi.new("struct kvp_done[]", 256)
        self.poller = select.poll()
        self.poller.register(lib.kvp_queue_fd(self.queue), select.POLLIN)
        self.settled: dict[int, tuple[str, str]] = {}
        self.batches: list[Batch] = []  # the C strings submitted items point to
        self.next_tag = 0

    def submit(self, root_fd: int, rels: Sequence[str], deadline_ns: int = 0) -> list[int]:
        batch = Batch(root_fd, rels, 4 * KiB)
        for item in batch.items[0:batch.n]:
            item.deadline_ns = deadline_ns
        self.batches.append(batch)
        tags = list(range(self.next_tag, self.next_tag + batch.n))
        self.next_tag += batch.n
        assert lib.kvp_queue_submit(self.queue, batch.items, ffi.new("uint64_t[]", tags),
                                    batch.n) == batch.n
        return tags

    def wait(self, tags: Sequence[int], seconds: float = 30.0) -> list[tuple[str, str]]:
        """Reap (and tick) until every tag is settled; their (outcome, errno name)."""
        deadline = time.monotonic() + seconds
        while not all(tag in self.settled for tag in tags):
            assert time.monotonic() < deadline, (
                f"{sum(t not in self.settled for t in tags)} files never settled: {self.stats()}")
            self.poller.poll(50)
            self.reap()
        return [self.settled[tag] for tag in tags]

    def reap(self) -> None:
        """Tick, and move what is settled into self.settled."""
        lib.kvp_queue_tick(self.queue)
        for k in range(lib.kvp_queue_reap(self.queue, self.out, 256)):
            done = self.out[k]
            self.settled[done.tag] = (OUTCOMES[done.outcome],
                                      errno.errorcode.get(done.err, "") if done.err else "")

    def wait_for(self, what: str, test: Any, seconds: float = 30.0) -> dict[str, int]:
        """Tick and reap until test(stats) holds; the stats then."""
        deadline = time.monotonic() + seconds
        while not test(stats := self.stats()):
            assert time.monotonic() < deadline, f"never {what}: {stats}"
            self.poller.poll(50)
            self.reap()
        self.reap()
        return stats

    def stats(self) -> dict[str, int]:
        stats: Any = ffi.new("struct kvp_queue_stats *")
        lib.kvp_queue_stats(self.queue, stats)
        return {name: int(getattr(stats, name)) for name in (
            "threads", "running", "stalled", "timed_out", "mount_threads", "mount_pending",
            "mount_running", "mount_stalled", "mount_moved", "mount_refused", "mount_stalls")}


def test_names_behind_a_mount_beneath_the_root_are_read_in_their_own_lane(
        root: Any, tmpfs_beneath: Path) -> None:
    """A file on a (healthy) mount beneath the root is read, through the other-mount lane;
    the root's own files and a symlink that escapes the root never go there. The same
    without openat2 (the component walk tells mounts apart by their ids)."""
    write_file(tmpfs_beneath / "f", 64 * KiB)
    write_file(root.path / "own", 64 * KiB)
    os.symlink("sub/f", root.path / "link")  # inside the root, onto the other mount
    os.symlink("/etc/passwd", root.path / "escape")
    lanes = Lanes()
    got = lanes.wait(lanes.submit(root.fd, ["sub/f", "own", "link", "escape"]))
    assert got == [("READ", ""), ("READ", ""), ("READ", ""), ("REJECTED", "EXDEV")]
    stats = lanes.stats()
    assert stats["mount_moved"] == 2 and stats["mount_refused"] == 0, stats
    assert 1 <= stats["mount_threads"] <= lib.KVP_QUEUE_OTHER_MOUNT_THREADS, stats

    walked = Lanes()
    lib.kvp_queue_force_fallback(walked.queue, lib.KVP_FALLBACK_OPENAT2)
    got = walked.wait(walked.submit(root.fd, ["sub/f", "own", "link"]))
    assert got == [("READ", ""), ("READ", ""), ("REJECTED", "ELOOP")]  # the walk follows none
    assert walked.stats()["mount_moved"] == 1


def test_a_hung_mount_beneath_the_root_holds_its_lane_only(root: Any, hung_beneath: Any) -> None:
    """Names under a hung FUSE mount hold at most the lane's threads (here 1), never the
    root's own files; once every lane thread is stuck past the stall time, the names waiting
    and those that come later fail at once with EHOSTDOWN (`mount_unresponsive`); a read
    that returns reopens the lane."""
    own = [f"own{i}" for i in range(8)]
    for name in own:
        write_file(root.path / name, 16 * KiB)
    lanes = Lanes(other_mount_threads=1)
    names = ["tier/hung/f0", "tier/hung/f1", "tier/hung/f2"]
    hung = lanes.submit(root.fd, names)
    assert lanes.wait(lanes.submit(root.fd, own)) == [("READ", "")] * len(own)
    hung_beneath.wait_held(1)
    assert not any(tag in lanes.settled for tag in hung)
    stuck = lanes.wait_for("stuck", lambda s: s["mount_stalled"] == 1,
                           seconds=STALL_SECONDS + 30)
    assert stuck["mount_threads"] == 1 and stuck["mount_running"] == 1, stuck
    # Stuck: what waited is refused (the root's lane moves names in no set order, so
    # any one of them may be the stuck read), and so is a name that comes now; the
    # root's own files are still read.
    lanes.wait_for("refusing", lambda s: s["mount_refused"] == 2)
    refused = [name for name, tag in zip(names, hung, strict=True) if tag in lanes.settled]
    held = [tag for tag in hung if tag not in lanes.settled]
    assert len(refused) == 2 and len(held) == 1
    assert lanes.wait([tag for tag in hung if tag not in held]) == [("FAILED", "EHOSTDOWN")] * 2
    assert lanes.wait(lanes.submit(root.fd, refused[:1])) == [("FAILED", "EHOSTDOWN")]
    assert lanes.wait(lanes.submit(root.fd, ["own0", "own1"])) == [("READ", "")] * 2
    assert lanes.stats()["mount_refused"] == 3
    # The server answers again: the stuck read completes and the lane takes names again.
    hung_beneath.release()
    assert lanes.wait(held) == [("READ", "")]
    assert lanes.wait(lanes.submit(root.fd, refused[1:])) == [("READ", "")]
    stats = lanes.stats()
    assert stats["mount_stalled"] == 0 and stats["mount_threads"] == 1, stats
    assert stats["stalled"] == 0 and stats["timed_out"] == 0, stats


def test_names_waiting_in_the_lane_still_expire_and_time_out(
        root: Any, hung_beneath: Any) -> None:
    """A name waiting behind the lane's stuck thread is settled at its deadline
    (EXPIRED) or at file_timeout (ETIMEDOUT), as in a root's lane, before the lane is
    stuck; the stuck read itself times out and keeps its thread."""
    lanes = Lanes(other_mount_threads=1, timeout_ns=int(1.0e9))
    first = lanes.submit(root.fd, ["tier/hung/f0"])
    hung_beneath.wait_held(1)
    soon = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + 100_000_000
    late = lanes.submit(root.fd, ["tier/hung/f1"], deadline_ns=soon)
    waiting = lanes.submit(root.fd, ["tier/hung/f2"])
    assert lanes.wait(late) == [("EXPIRED", "")]
    assert lanes.wait(first + waiting) == [("FAILED", "ETIMEDOUT")] * 2
    stats = lanes.stats()
    assert stats["mount_threads"] == 1 and stats["mount_running"] == 1, stats
    hung_beneath.release()
    lanes.wait_for("free", lambda s: s["mount_running"] == 0)


def test_a_root_starts_at_the_depth_given_it(
        tmp_path: Path) -> None:
    queue = new_queue(initial_depth=16, max_threads=64)
    hinted = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    plain = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        lib.kvp_queue_root_depth(queue, hinted, 6)  # a FUSE mount's share of max_background
        lib.kvp_queue_root_depth(queue, plain, 0)  # 0: left as configured, not even made
        stats = ffi.new("struct kvp_queue_stats *")
        lib.kvp_queue_stats(queue, stats)
        depths = {stats.root_fd[i]: stats.root_depth[i] for i in range(stats.nroots)}
        assert depths == {hinted: 6}
    finally:
        os.close(hinted)
        os.close(plain)
