"""The router's and the operator's verbs through the real daemon: why each file failed,
deadlines (on the slow-tier simulator too: an expired file takes no fetch slot), check,
evict, and atime.

Residency is read back with mincore (bench/kvharness/pagecache.py); atime after setting it
two days back, which relatime refreshes on any read.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvharness.daemon import Daemon, start_on
from kvharness.files import make_files, write
from kvharness.fixtures import call, mount_tier, ok
from kvharness.pagecache import pinned, resident_bytes
from kvharness.wire import RawConnection

KiB, MiB = 1 << 10, 1 << 20
TWO_DAYS = 2 * 86400


def age_atime(path: str) -> float:
    st = os.stat(path)
    os.utime(path, (time.time() - TWO_DAYS, st.st_mtime))
    return os.stat(path).st_atime


def start(tmp_path: Path, kv: Path, **settings: Any) -> Daemon:
    return start_on(tmp_path, kv, read_bytes=64 * KiB, **settings)



def test_a_wait_reply_names_every_file_not_warmed_and_why(tmp_path: Path, kv: Path) -> None:
    good = write(kv / "good", 128 * KiB)
    (kv / "dir").mkdir()
    (tmp_path / "secret").write_bytes(b"x" * 4096)
    os.symlink(tmp_path / "secret", kv / "escape")
    daemon = start(tmp_path, kv)
    try:
        reply = ok(daemon, "prefetch", wait=True, paths=[
            good, str(kv / "nope"), str(kv / "dir"), str(kv / "escape"), "/etc/passwd",
            "relative/x", f"{kv}/../etc/passwd"])
        truncated = ok(daemon, "prefetch", wait=True, max_failures=1,
                       paths=[str(kv / f"missing{i}") for i in range(5)])
    finally:
        daemon.stop()
    assert reply["outcomes"]["read"] == 1
    failures = {(f["path"], f["outcome"], f["reason"]) for f in reply["failures"]}
    assert failures == {
        (str(kv / "nope"), "missing", "ENOENT"),
        (str(kv / "dir"), "rejected", "not_regular"),
        (str(kv / "escape"), "rejected", "symlink_escape"),
        ("/etc/passwd", "rejected", "outside_roots"),
        ("relative/x", "rejected", "relative"),
        (f"{kv}/../etc/passwd", "rejected", "dotdot"),
    }
    assert reply["failures_truncated"] == 0
    assert len(truncated["failures"]) == 1 and truncated["failures_truncated"] == 4
    assert truncated["outcomes"]["missing"] == 5


def test_every_gate_names_its_reason(tmp_path: Path, kv: Path) -> None:
    """The supervisor's lexical gate and the worker's kernel gate, one reason each."""
    os.symlink("loop_b", kv / "loop_a")
    os.symlink("loop_a", kv / "loop_b")
    long_name = str(kv / ("x" * 300))  # a component over NAME_MAX
    too_long = str(kv / ("d/" * 300))
    daemon = start(tmp_path, kv, max_path_bytes=512)
    try:
        reply = ok(daemon, "prefetch", wait=True, paths=[
            f"{kv}/a\0b", too_long, 7, f"{kv}/", str(kv / "loop_a"), long_name])
    finally:
        daemon.stop()
    reasons = {(str(f["path"]), f["outcome"], f["reason"]) for f in reply["failures"]}
    assert reasons == {
        (f"{kv}/a\0b", "rejected", "nul_byte"),
        (too_long, "rejected", "too_long"),
        ("7", "rejected", "not_a_path"),
        (f"{kv}/", "rejected", "not_a_file"),
        (str(kv / "loop_a"), "rejected", "symlink_loop"),
        (long_name, "rejected", "bad_name"),
    }, reply


def test_a_worker_that_dies_names_its_files_lost(tmp_path: Path,
                                                tier_files: tuple[Path, Path]) -> None:
    backing, mountpoint = tier_files
    names = make_files(backing, 6, 64 * KiB, folder="held")
    with mount_tier(backing, mountpoint, latency_ms=1) as tier:
        daemon = start_on(tmp_path, mountpoint, read_bytes=256 * KiB, workers=1,
                          residency_by_root={str(mountpoint): "off"})
        try:
            tier.evict_all()
            with tier.hang("read", "/held/"), RawConnection(daemon.socket_path, 60) as waiting:
                waiting.send({"v": 1, "id": 1, "op": "prefetch", "wait": True,
                              "paths": [str(mountpoint / name) for name in names]})
                tier.wait_held(len(names))
                os.kill(daemon.worker_pids()[0], signal.SIGKILL)
                reply = waiting.recv()
        finally:
            daemon.stop()
    assert reply["outcomes"]["failed"] == 6
    assert {(f["outcome"], f["reason"]) for f in reply["failures"]} == {("failed",
                                                                          "worker_lost")}
    assert sorted(f["path"] for f in reply["failures"]) == sorted(
        str(mountpoint / name) for name in names)


def test_an_ack_lists_what_was_turned_away_and_the_room_left(tmp_path: Path, kv: Path) -> None:
    paths = [write(kv / f"f{i}", 4096) for i in range(40)]
    daemon = start(tmp_path, kv, workers=1, queue_limit=8)
    try:
        ack = ok(daemon, "prefetch", paths=[*paths, "/elsewhere"])
        give_up = time.monotonic() + 10
        while (idle := ok(daemon, "prefetch", paths=[]))["room"] < 8:
            assert time.monotonic() < give_up, idle  # the 8 files settle: room comes back
            time.sleep(0.05)
    finally:
        daemon.stop()
    assert ack["accepted"] == 8 and ack["dropped"] == 32 and ack["rejected"] == 1
    assert ack["room"] == 0
    dropped = [f["path"] for f in ack["failures"] if f["reason"] == "dropped_queue_full"]
    assert dropped == paths[8:]  # the caller's own paths: it can send exactly these again
    assert {"path": "/elsewhere", "outcome": "rejected", "reason": "outside_roots"} in \
        ack["failures"]
    assert idle["room"] == 8 and "failures" not in idle


def test_a_past_deadline_reads_nothing(tmp_path: Path, kv: Path) -> None:
    paths = [write(kv / f"f{i}", 64 * KiB) for i in range(20)]
    daemon = start(tmp_path, kv)
    try:
        past = int(time.time() * 1000) - 1000
        reply = ok(daemon, "prefetch", wait=True, paths=paths, deadline_unix_ms=past)
        both = call(daemon, "prefetch", paths=paths, deadline_ms=5, deadline_unix_ms=past)
        stats = daemon.stats()
    finally:
        daemon.stop()
    assert reply["outcomes"]["expired"] == 20 and reply["outcomes"]["read"] == 0
    assert {f["reason"] for f in reply["failures"]} == {"deadline"}
    assert all(resident_bytes(path, 64 * KiB) == 0 for path in paths)
    assert not both["ok"] and both["error"]["code"] == "bad_request"
    assert stats["files"]["expired"] == 20


def test_expired_files_take_no_fetch_slot_on_a_slow_tier(
    tmp_path: Path, tier_files: tuple[Path, Path]
) -> None:
    """100 ms fetches, and a worker allowed 2 reads in flight: 40 files need 2 s. With a
    350 ms deadline only the files issued by then are fetched; the rest expire in the
    worker's queue, unfetched: the tier never sees them."""
    backing, mountpoint = tier_files
    names = make_files(backing, 40, 256 * KiB)
    paths = [str(mountpoint / name) for name in names]
    with mount_tier(backing, mountpoint, latency_ms=100) as tier:
        daemon = start_on(tmp_path, mountpoint, read_bytes=256 * KiB,
                          residency_by_root={str(mountpoint): "off"},
                          default_deadline_ms=350, workers=1, initial_depth=2,
                          max_in_flight=2)
        try:
            tier.evict_all()
            tier.reset_stats()
            reply = ok(daemon, "prefetch", wait=True, paths=paths)
            fetched = tier.stats().fetches
            tier.evict_all()
            tier.reset_stats()
            undeadlined = ok(daemon, "prefetch", wait=True, paths=paths[-6:], deadline_ms=0)
        finally:
            daemon.stop()
    outcomes = reply["outcomes"]
    assert outcomes["read"] + outcomes["expired"] == 40
    assert 2 <= outcomes["read"] <= 16 and outcomes["expired"] >= 24, outcomes
    assert fetched == outcomes["read"], (fetched, outcomes)  # expired: never fetched
    assert undeadlined["outcomes"]["read"] == 6  # deadline_ms 0: no default deadline


def test_check_reports_residency_without_reading_or_touching_atime(
    tmp_path: Path, kv: Path
) -> None:
    cold = write(kv / "cold", MiB)
    warm = write(kv / "warm", 256 * KiB)
    before = age_atime(cold)
    with pinned([warm]) as pin:  # read and mlocked: no reclaimer or drop_caches takes it
        daemon = start(tmp_path, kv)
        try:
            pin.require_all()
            summary = ok(daemon, "check", paths=[cold, warm, str(kv / "nope"), "/etc/passwd"])
            detailed = ok(daemon, "check", paths=[cold, warm], details=True, read_bytes=MiB)
            stats = daemon.stats()
        finally:
            daemon.stop()
    assert os.stat(cold).st_atime == before, "check changed atime"
    assert resident_bytes(cold, MiB) == 0, "check read the file"
    assert summary["states"] == {"resident": 1, "cold": 1, "missing": 1, "rejected": 1,
                                 "failed": 0, "dropped": 0, "expired": 0, "futile": 0}
    assert summary["files"] == 4 and summary["resident_files"] == 1
    assert summary["size_bytes"] == MiB + 256 * KiB
    assert summary["resident_bytes"] == 256 * KiB
    assert "results" not in summary
    by_path = {r["path"]: r for r in detailed["results"]}
    assert by_path[cold]["state"] == "cold" and by_path[cold]["resident_bytes"] == 0
    assert by_path[warm]["state"] == "resident"
    assert by_path[warm]["size"] == 256 * KiB and by_path[warm]["tier_bytes"] >= 256 * KiB
    assert stats["events"]["files_checked"] == 5  # the workers looked at 3 + 2
    assert stats["files"]["accepted"] == 0  # a check is no warm-up


def test_evict_is_refused_unless_allowed(tmp_path: Path, kv: Path) -> None:
    path = write(kv / "f", 64 * KiB)
    daemon = start(tmp_path, kv)
    try:
        reply = call(daemon, "evict", paths=[path])
    finally:
        daemon.stop()
    assert not reply["ok"] and reply["error"]["code"] == "forbidden"
    assert "allow_evict" in reply["error"]["message"]


def test_evict_drops_heads_and_the_next_warm_reads_again(tmp_path: Path, kv: Path) -> None:
    paths = [write(kv / f"f{i}", 256 * KiB) for i in range(8)]
    daemon = start(tmp_path, kv, allow_evict=True)
    try:
        assert ok(daemon, "prefetch", wait=True, paths=paths)["outcomes"]["read"] == 8
        evicted = ok(daemon, "evict", paths=paths[:4], read_bytes=64 * KiB)
        whole = ok(daemon, "evict", paths=paths[4:], whole=True, details=True)
        # Within the dedup memory (1 s): without the eviction it would answer `resident`.
        again = ok(daemon, "prefetch", wait=True, paths=paths)
    finally:
        daemon.stop()
    assert evicted["evicted_files"] == 4 and evicted["states"]["cold"] == 4
    assert whole["evicted_files"] == 4 and whole["resident_bytes"] == 0
    assert all(r["resident_bytes"] == 0 for r in whole["results"])
    assert again["outcomes"]["read"] == 8


@pytest.mark.parametrize("preserve", [False, True])
def test_preserve_atime(tmp_path: Path, kv: Path, preserve: bool) -> None:
    paths = [write(kv / f"f{i}", 64 * KiB) for i in range(4)]
    before = [age_atime(path) for path in paths]
    daemon = start(tmp_path, kv, preserve_atime=preserve)
    try:
        assert ok(daemon, "prefetch", wait=True, paths=paths)["outcomes"]["read"] == 4
        stats = daemon.stats()
    finally:
        daemon.stop()
    after = [os.stat(path).st_atime for path in paths]
    if preserve:
        assert after == before
        assert stats["events"].get("noatime_fallbacks", 0) == 0  # root may: no fallback
    else:
        assert all(a > b for a, b in zip(after, before, strict=True))
