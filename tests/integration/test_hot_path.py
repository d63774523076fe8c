"""The hot path through the real daemon: warm and missing files answered by the workers'
probe (native/probe.c) and the supervisor's native admission, with the same outcomes,
names and reasons as the engines give, and never on a root the probe must not touch.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

from kvharness.daemon import Daemon, start_on
from kvharness.files import make_files, write
from kvharness.fixtures import mount_tier, ok
from kvharness.pagecache import Pin, pinned

KiB = 1024


def probed(daemon: Daemon) -> tuple[int, int]:
    workers = daemon.call("stats")["stats"]["workers"]
    return (sum(w["probed_resident"] for w in workers),
            sum(w["probed_missing"] for w in workers))


def test_warm_and_missing_files_are_answered_by_the_probe_alike(tmp_path: Path,
                                                                 kv: Path) -> None:
    hot = [write(kv / f"hot{i}", 64 * KiB) for i in range(200)]
    cold = [write(kv / f"cold{i}", 64 * KiB) for i in range(20)]  # evicted, verified
    absent = [str(kv / f"absent{i}") for i in range(30)]
    # The hot heads are read and mlocked for the whole test: the host's reclaimer and
    # other tests' drop_caches cannot take them between this read and the daemon's look.
    with pinned(hot) as pin:
        daemon = start_on(tmp_path, kv, read_bytes=64 * KiB, dedup_ttl_ms=0)
        try:
            warm = pin.kept()  # all 200 when mlocked; else the ones the reclaimer left
            first = ok(daemon, "prefetch", paths=hot + cold + absent, wait=True,
                       max_failures=1000)
            # The absent names were never looked up: the engines said `missing` (and the
            # kernel now keeps their negative dentries), so from now on the probe does.
            second, rounds = until_the_probe_answers_all(daemon, pin, absent)
            fired = daemon.stats()["files"]
            warm_fired = pin.kept()
            fire = ok(daemon, "prefetch", paths=hot + absent)
            assert fire["accepted"] == len(hot) + len(absent)
            give_up = time.monotonic() + 30
            while (settled := daemon.stats()["files"])["in_flight"]:  # fire-and-forget
                assert time.monotonic() < give_up
                time.sleep(0.01)
        finally:
            daemon.stop()
    assert first["outcomes"]["resident"] == len(warm), (first["outcomes"], pin.why)
    assert first["outcomes"]["read"] == len(cold) + len(hot) - len(warm)
    assert first["outcomes"]["missing"] == len(absent)
    # Named and explained as the engines name them, whoever settled them.
    for reply in (first, second):
        assert sorted(f["path"] for f in reply["failures"]) == sorted(absent)
        assert {(f["outcome"], f["reason"]) for f in reply["failures"]} == {
            ("missing", "ENOENT")}
    assert settled["resident"] - fired["resident"] == len(warm_fired)
    assert settled["missing"] - fired["missing"] == len(absent)
    print(f"the probe answered a whole request in round {rounds}")


def until_the_probe_answers_all(daemon: Daemon, pin: Pin,
                                absent: list[str]) -> tuple[dict[str, Any], int]:
    """Ask for the warm and absent names until one request is settled by the probe alone:
    every warm head `resident`, every absent name `missing`. Each reply must be exact
    whoever settled it; the probe hands the rest of a call to the queue after any file
    slower than 1 ms (KVP_PROBE_SLOW_NS), so a worker preempted on this shared machine
    may leave part of a round to the queue. The reply and the round it took."""
    give_up = time.monotonic() + 60
    for rounds in itertools.count(1):
        warm = pin.kept()
        before = probed(daemon)
        reply = ok(daemon, "prefetch", paths=pin.paths + absent, wait=True,
                   max_failures=1000)
        after = probed(daemon)
        assert reply["outcomes"]["resident"] == len(warm), (reply["outcomes"], pin.why)
        assert reply["outcomes"]["read"] == len(pin.paths) - len(warm)
        assert reply["outcomes"]["missing"] == len(absent)
        if (after[0] - before[0], after[1] - before[1]) == (len(warm), len(absent)):
            return reply, rounds
        assert time.monotonic() < give_up, f"the probe never answered a whole round {after}"
    raise AssertionError("unreachable")


def test_every_spelling_and_every_root_lands_where_the_python_gate_puts_it(
        tmp_path: Path) -> None:
    """Two roots, one nested in the other; spellings the canonical form collapses."""
    outer, inner = tmp_path / "kv", tmp_path / "kv" / "deep"
    inner.mkdir(parents=True)
    a, b = write(outer / "a.bin", 4 * KiB), write(inner / "b.bin", 4 * KiB)
    daemon = start_on(tmp_path, outer, read_bytes=64 * KiB, roots=[str(outer), str(inner)],
                      dedup_ttl_ms=0)
    try:
        paths: list[Any] = [a, f"{outer}//a.bin", f"{outer}/./a.bin", b, f"{inner}//b.bin",
                            f"{outer}/deep/../a.bin", "relative", f"{outer}/", str(tmp_path)]
        reply = ok(daemon, "prefetch", paths=paths, wait=True, max_failures=100)
    finally:
        daemon.stop()
    assert reply["accepted"] == 5
    assert reply["outcomes"]["read"] + reply["outcomes"]["resident"] == 5
    assert {(f["path"], f["reason"]) for f in reply["failures"]} == {
        (f"{outer}/deep/../a.bin", "dotdot"), ("relative", "relative"),
        (f"{outer}/", "not_a_file"), (str(tmp_path), "outside_roots")}


def test_a_fuse_root_is_never_probed(tmp_path: Path, tier_files: tuple[Path, Path]) -> None:
    """A FUSE tier's opens wait on its server: the queue's threads take them, never the
    worker's own thread (which a hung tier would stop)."""
    backing, mountpoint = tier_files
    names = make_files(backing, 40, 64 * KiB)
    with mount_tier(backing, mountpoint, latency_ms=1):
        daemon = start_on(tmp_path, mountpoint, read_bytes=256 * KiB, dedup_ttl_ms=0,
                          residency_by_root={str(mountpoint): "pagecache"})
        try:
            paths = [str(mountpoint / name) for name in names]
            for _ in range(2):
                reply = ok(daemon, "prefetch", paths=paths, wait=True)
                assert reply["outcomes"]["read"] + reply["outcomes"]["resident"] == 40
            assert probed(daemon) == (0, 0)
        finally:
            daemon.stop()


def test_a_symlink_out_of_the_root_to_a_resident_file_is_rejected_never_resident(
        tmp_path: Path, kv: Path) -> None:
    """The probe resolves beneath the root too: what leads out is the queue's to refuse."""
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * 4096)
    with open(outside, "rb") as handle:
        handle.read()
    os.symlink(outside, kv / "escape")
    os.symlink("../secret", kv / "dotdot")
    daemon = start_on(tmp_path, kv, read_bytes=64 * KiB, dedup_ttl_ms=0)
    try:
        for _ in range(2):
            reply = ok(daemon, "prefetch", paths=[str(kv / "escape"), str(kv / "dotdot")],
                       wait=True)
            assert reply["outcomes"]["rejected"] == 2, reply
            assert {f["reason"] for f in reply["failures"]} == {"symlink_escape"}
    finally:
        daemon.stop()
