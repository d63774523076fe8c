"""The hot path through the real daemon: warm and missing files answered by the workers'
probe (native/probe.c) and the supervisor's native admission, with the same outcomes,
names and reasons as the engines give, and never on a root the probe must not touch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from test_tier import daemon_on, make_files, mount
from test_verbs import ok, start, write

from kvharness.daemon import Daemon
from kvharness.pagecache import evict

KiB = 1024


def probed(daemon: Daemon) -> tuple[int, int]:
    workers = daemon.call("stats")["stats"]["workers"]
    return (sum(w["probed_resident"] for w in workers),
            sum(w["probed_missing"] for w in workers))


@pytest.fixture
def kv(tmp_path: Path) -> Path:
    root = tmp_path / "kv"
    root.mkdir()
    return root


def test_warm_and_missing_files_are_answered_by_the_probe_alike(tmp_path: Path,
                                                                 kv: Path) -> None:
    hot = [write(kv / f"hot{i}", 64 * KiB) for i in range(200)]
    cold = [write(kv / f"cold{i}", 64 * KiB) for i in range(20)]
    for path in hot:
        with open(path, "rb") as handle:
            handle.read()
    for path in cold:
        evict(path)
    absent = [str(kv / f"absent{i}") for i in range(30)]
    daemon = start(tmp_path, kv, dedup_ttl_ms=0)
    try:
        first = ok(daemon, "prefetch", paths=hot + cold + absent, wait=True, max_failures=1000)
        # The absent names were never looked up: the engines said `missing` (and the kernel
        # now keeps their negative dentries), so the second time the probe says it.
        second = ok(daemon, "prefetch", paths=hot + absent, wait=True, max_failures=1000)
        fire = ok(daemon, "prefetch", paths=hot + absent)
        assert fire["accepted"] == len(hot) + len(absent)
        give_up = time.monotonic() + 30
        while daemon.stats()["files"]["in_flight"]:  # the fire-and-forget files settle
            assert time.monotonic() < give_up
            time.sleep(0.01)
        resident, missing = probed(daemon)
    finally:
        daemon.stop()
    # The host's reclaimer may take a few warm heads before the daemon looks: those are
    # read, never lost (a ~1% late eviction is tolerated, as everywhere here).
    assert first["outcomes"]["read"] + first["outcomes"]["resident"] == len(hot) + len(cold)
    assert first["outcomes"]["read"] >= len(cold)
    assert first["outcomes"]["resident"] >= 0.97 * len(hot), first["outcomes"]
    assert first["outcomes"]["missing"] == len(absent)
    assert second["outcomes"]["read"] + second["outcomes"]["resident"] == len(hot)
    assert second["outcomes"]["missing"] == len(absent)
    # Named and explained as the engines name them, whoever settled them.
    for reply in (first, second):
        assert sorted(f["path"] for f in reply["failures"]) == sorted(absent)
        assert {(f["outcome"], f["reason"]) for f in reply["failures"]} == {
            ("missing", "ENOENT")}
    assert resident >= 0.97 * 3 * len(hot)  # all three times, but for a reclaimed head
    assert missing >= 2 * len(absent)


def test_every_spelling_and_every_root_lands_where_the_python_gate_puts_it(
        tmp_path: Path) -> None:
    """Two roots, one nested in the other; spellings the canonical form collapses."""
    outer, inner = tmp_path / "kv", tmp_path / "kv" / "deep"
    inner.mkdir(parents=True)
    a, b = write(outer / "a.bin", 4 * KiB), write(inner / "b.bin", 4 * KiB)
    daemon = start(tmp_path, outer, roots=[str(outer), str(inner)], dedup_ttl_ms=0)
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
    with mount(backing, mountpoint, latency_ms=1):
        daemon = daemon_on(tmp_path, mountpoint, dedup_ttl_ms=0,
                           residency_by_root={str(mountpoint): "pagecache"})
        try:
            paths = [str(mountpoint / name) for name in names]
            for _ in range(2):
                reply = ok(daemon, "prefetch", paths=paths, wait=True)
                assert reply["outcomes"]["read"] + reply["outcomes"]["resident"] == 40
            assert probed(daemon) == (0, 0)
        finally:
            daemon.stop()


@pytest.fixture
def tier_files(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "backing").mkdir()
    (tmp_path / "mnt").mkdir()
    return tmp_path / "backing", tmp_path / "mnt"


def test_a_symlink_out_of_the_root_to_a_resident_file_is_rejected_never_resident(
        tmp_path: Path, kv: Path) -> None:
    """The probe resolves beneath the root too: what leads out is the queue's to refuse."""
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * 4096)
    with open(outside, "rb") as handle:
        handle.read()
    os.symlink(outside, kv / "escape")
    os.symlink("../secret", kv / "dotdot")
    daemon = start(tmp_path, kv, dedup_ttl_ms=0)
    try:
        for _ in range(2):
            reply = ok(daemon, "prefetch", paths=[str(kv / "escape"), str(kv / "dotdot")],
                       wait=True)
            assert reply["outcomes"]["rejected"] == 2, reply
            assert {f["reason"] for f in reply["failures"]} == {"symlink_escape"}
    finally:
        daemon.stop()
