"""The daemon on a slow tier: the FUSE simulator (bench/tiersim) under the real daemon.

What a local disk hides: every cold file's first read waits for a fetch. Checked here,
functionally (no timing is asserted beyond what the model makes certain): the reads in
flight grow past a fixed pool's when the tier rewards them, a slot-capped tier keeps
its slots full, the tier residency rule reads st_blocks end to end, a worker waiting on
a slow tier is heard and never killed as wedged, and a hung part of the tier holds
neither the worker nor the other files (they are served, the hung ones fail on time).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from kvharness.daemon import Daemon, start_on
from kvharness.files import make_files
from kvharness.fixtures import mount_tier, ok
from kvharness.wire import RawConnection

KiB, MiB = 1 << 10, 1 << 20


def daemon_on(workdir: Path, mountpoint: Path, **settings: Any) -> Daemon:
    return start_on(workdir, mountpoint, read_bytes=256 * KiB, log_level="debug", **settings)


def warm(daemon: Daemon, paths: list[str], **fields: Any) -> dict[str, Any]:
    return ok(daemon, "prefetch", timeout=300, paths=paths, wait=True, **fields)


def test_reads_in_flight_grow_past_a_fixed_pool_on_a_tier_that_rewards_them(
    tmp_path: Path, tier_files: tuple[Path, Path]
) -> None:
    backing, mountpoint = tier_files
    names = make_files(backing, 600, 512 * KiB)
    with mount_tier(backing, mountpoint, latency_ms=50) as tier:
        daemon = daemon_on(tmp_path, mountpoint, residency_by_root={str(mountpoint): "off"})
        try:
            tier.evict_all()
            tier.reset_stats()
            reply = warm(daemon, [str(mountpoint / name) for name in names])
            stats = tier.stats()
        finally:
            daemon.stop()
    assert reply["outcomes"]["read"] == 600
    assert stats.fetches == 600  # every head fetched, once
    # The old engine held 16 reads per worker; the queue doubles while the tier keeps
    # its service time, so two workers go well past 32 on 50 ms fetches.
    assert stats.peak_in_flight > 64, stats


def test_a_slot_capped_tier_keeps_its_slots_full_and_no_more(
    tmp_path: Path, tier_files: tuple[Path, Path]
) -> None:
    backing, mountpoint = tier_files
    names = make_files(backing, 400, 256 * KiB)
    with mount_tier(backing, mountpoint, latency_ms=20, slots=16) as tier:
        daemon = daemon_on(tmp_path, mountpoint, residency_by_root={str(mountpoint): "off"})
        try:
            tier.evict_all()
            tier.reset_stats()
            reply = warm(daemon, [str(mountpoint / name) for name in names])
            stats = tier.stats()
            figures = daemon.stats()
        finally:
            daemon.stop()
    assert reply["outcomes"]["read"] == 400 and stats.fetches == 400
    assert stats.peak_in_flight == 16  # the tier's slots, all used
    assert figures["workers_killed_wedged"] == 0


def test_the_tier_rule_reads_st_blocks_end_to_end(
    tmp_path: Path, tier_files: tuple[Path, Path]
) -> None:
    """auto picks the tier rule for the simulator's file system: a fetched file is
    resident without a read, an evicted one (a stub again) is read again."""
    backing, mountpoint = tier_files
    names = make_files(backing, 40, 512 * KiB)
    paths = [str(mountpoint / name) for name in names]
    with mount_tier(backing, mountpoint, latency_ms=5) as tier:
        # No dedup memory (dedup_ttl_ms 0): every answer below is the rule's.
        daemon = daemon_on(tmp_path, mountpoint, dedup_ttl_ms=0)
        try:
            root = daemon.stats()["roots"][0]
            assert (root["fstype"], root["rule"]) == ("fuse.tiersim", "tier"), root
            tier.evict_all()
            assert all(os.stat(path).st_blocks == 0 for path in paths)  # stubs
            assert warm(daemon, paths)["outcomes"]["read"] == 40
            assert all(os.stat(path).st_blocks > 0 for path in paths)
            tier.reset_stats()
            assert warm(daemon, paths)["outcomes"]["resident"] == 40
            assert tier.stats().fetches == 0  # st_blocks said so: nothing read
            tier.evict(mountpoint / "m")
            assert warm(daemon, paths)["outcomes"]["read"] == 40
            assert tier.stats().fetches == 40
        finally:
            daemon.stop()


def test_a_worker_waiting_on_a_slow_tier_is_heard_and_never_killed(
    tmp_path: Path, tier_files: tuple[Path, Path]
) -> None:
    """One fetch slot, 0.4 s a fetch: 12 files outlast worker_timeout (2 s) twice over,
    but the worker says it is alive while they are out: progress, not wedged."""
    backing, mountpoint = tier_files
    names = make_files(backing, 12, 64 * KiB)
    with mount_tier(backing, mountpoint, latency_ms=400, slots=1) as tier:
        daemon = daemon_on(tmp_path, mountpoint, workers=1, worker_timeout=2,
                           residency_by_root={str(mountpoint): "off"})
        try:
            tier.evict_all()
            reply = warm(daemon, [str(mountpoint / name) for name in names])
            stats = daemon.stats()
        finally:
            daemon.stop()
    assert reply["outcomes"]["read"] == 12
    assert reply["elapsed_us"] > 2 * 2_000_000  # longer than worker_timeout, by construction
    assert stats["workers_killed_wedged"] == 0 and stats["worker_restarts"] == 0


def test_a_hung_part_of_the_tier_holds_neither_the_worker_nor_the_other_files(
    tmp_path: Path, tier_files: tuple[Path, Path]
) -> None:
    """Reads under one folder never return: the other folder's files are served while
    they hang, the hung ones fail at file_timeout, the worker is never killed."""
    backing, mountpoint = tier_files
    hung = make_files(backing, 20, 64 * KiB, folder="hung")
    healthy = make_files(backing, 200, 64 * KiB, folder="fine")
    with mount_tier(backing, mountpoint, latency_ms=10) as tier:
        daemon = daemon_on(tmp_path, mountpoint, workers=1, file_timeout=3,
                           worker_timeout=60, residency_by_root={str(mountpoint): "off"})
        try:
            tier.evict_all()
            with tier.hang("read", "/hung/"):
                with RawConnection(daemon.socket_path, 60) as stuck:
                    stuck.send({"v": 1, "id": 1, "op": "prefetch", "wait": True,
                                "paths": [str(mountpoint / name) for name in hung]})
                    tier.wait_held(len(hung))
                    served = warm(daemon, [str(mountpoint / name) for name in healthy])
                    # Served while the hung reads were still held and their request
                    # still unanswered: they did not stand in the way.
                    still_held = tier.stats().held
                    stuck.sock.setblocking(False)
                    with pytest.raises(BlockingIOError):
                        stuck.sock.recv(1, socket.MSG_PEEK)
                    stuck.sock.setblocking(True)
                    late = stuck.recv()
                stats = daemon.stats()
        finally:
            daemon.stop()
    assert served["outcomes"]["read"] == 200 and still_held >= 20
    assert late["outcomes"]["failed"] == 20, late  # settled at file_timeout, not never
    assert {(f["outcome"], f["reason"]) for f in late["failures"]} == {("failed", "ETIMEDOUT")}
    assert stats["workers_killed_wedged"] == 0 and stats["worker_restarts"] == 0
