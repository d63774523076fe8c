"""A root's depth and its tier's fastest fetch (native/depthctl.c), on the simulator.

A root started at a depth its tier profile trusts pays no ramp: the start holds where the
tier serves that many fetches at once. Where it serves fewer (fetch slots, an AFM gateway's
threads), its windows bring the depth down to what was served (Little's law), so reads wait
in the daemon, where a more urgent file can overtake them, not inside the file system.

The fastest fetch (the floor) judges admission (schedule.c): a read or two that came back
sooner than any fetch (one that joined a fetch already out) may move it by a tenth a window
at most; a tier that got faster moves it all the way.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from native_helpers import Batch, KiB, new_queue, open_root, write_file

import tiersim
from kvharness.fixtures import require_fuse
from kvprefetchd._native import ffi, lib

FILES = 160
START = 64
LATENCY_MS = 40.0


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    path = tmp_path / "backing"
    path.mkdir()
    for i in range(FILES):
        write_file(path / f"f{i:03d}", 16 * KiB)
    return path


@pytest.fixture
def mountpoint(tmp_path: Path) -> Path:
    path = tmp_path / "mnt"
    path.mkdir()
    return path


@pytest.fixture
def tier_of(backing: Path, mountpoint: Path) -> Iterator[Any]:
    def mount(slots: int) -> Any:
        return tiersim.mount(backing, mountpoint, latency_ms=LATENCY_MS, slots=slots)
    require_fuse()
    yield mount


def depths_while_warming(mountpoint: Path) -> tuple[int, int]:
    """(depth at the start, least depth seen while FILES cold files were read) of a root
    started at a trusted depth. The least, not the last: past its first window the depth
    is the hill climb's, which probes upward now and then (depthctl.c)."""
    queue = new_queue(initial_depth=4, max_threads=128)
    root_fd = open_root(mountpoint)
    try:
        lib.kvp_queue_root_depth(queue, root_fd, START)
        stats: Any = ffi.new("struct kvp_queue_stats *")
        lib.kvp_queue_stats(queue, stats)
        start = least = int(stats.root_depth[0])
        batch = Batch(root_fd, [f"f{i:03d}" for i in range(FILES)], 16 * KiB)
        tags = ffi.new("uint64_t[]", list(range(FILES)))
        assert lib.kvp_queue_submit(queue, batch.items, tags, FILES) == FILES
        out = ffi.new("struct kvp_done[]", FILES)
        poller = select.poll()
        poller.register(lib.kvp_queue_fd(queue), select.POLLIN)
        reaped, deadline = 0, time.monotonic() + 60
        while reaped < FILES:
            assert time.monotonic() < deadline, f"{FILES - reaped} files never settled"
            poller.poll(20)
            lib.kvp_queue_tick(queue)
            reaped += lib.kvp_queue_reap(queue, out, FILES)
            lib.kvp_queue_stats(queue, stats)
            least = min(least, int(stats.root_depth[0]))
        return start, least
    finally:
        os.close(root_fd)


def test_a_trusted_start_comes_down_to_the_fetches_the_tier_serves(
        tier_of: Any, mountpoint: Path) -> None:
    with tier_of(slots=4) as tier:
        start, least = depths_while_warming(mountpoint)
        assert tier.stats().fetches >= FILES
    assert start == START
    assert least <= 8, f"4 fetch slots, yet the depth never came below {least}"


def test_a_trusted_start_holds_where_the_tier_serves_it(
        tier_of: Any, mountpoint: Path) -> None:
    with tier_of(slots=0):
        start, least = depths_while_warming(mountpoint)
    assert start == START
    assert least >= START // 2, f"no cap on fetches, yet the depth fell to {least}"


def floors_while_reading(queue: Any, root_fd: int, names: list[str]) -> list[int]:
    """The root's floor (us) after each file of `names` settled, read without a deadline."""
    batch = Batch(root_fd, names, 16 * KiB)
    tags = ffi.new("uint64_t[]", list(range(len(names))))
    assert lib.kvp_queue_submit(queue, batch.items, tags, len(names)) == len(names)
    out = ffi.new("struct kvp_done[]", len(names))
    stats: Any = ffi.new("struct kvp_queue_stats *")
    floors: list[int] = []
    deadline = time.monotonic() + 30
    while len(floors) < len(names):
        assert time.monotonic() < deadline, "files never settled"
        for k in range(lib.kvp_queue_reap(queue, out, len(names))):
            assert out[k].outcome == lib.KVP_OUT_READ, out[k].err
            lib.kvp_queue_stats(queue, stats)
            floors.append(int(stats.root_floor_us[0]))
        time.sleep(0.002)
    return floors


def test_a_read_or_two_faster_than_the_tier_leave_its_floor(
        tier_of: Any, mountpoint: Path) -> None:
    queue = new_queue(initial_depth=4, max_threads=4)
    fetch_us = int(LATENCY_MS * 1000)
    with tier_of(slots=0) as tier:
        root_fd = open_root(mountpoint)
        try:
            floors = floors_while_reading(queue, root_fd, [f"f{i:03d}" for i in range(16)])
            assert fetch_us <= floors[-1] < 2 * fetch_us, floors
            tier.set(latency_ms=LATENCY_MS / 10)  # two reads as fast as a joined fetch
            floors = floors_while_reading(queue, root_fd, ["f016", "f017"])
            tier.set(latency_ms=LATENCY_MS)
            floors += floors_while_reading(queue, root_fd, [f"f{i:03d}" for i in range(18, 34)])
            assert min(floors) >= 0.8 * fetch_us, floors  # was 4.4 ms: the fastest read

            tier.set(latency_ms=LATENCY_MS / 10)  # the tier itself got faster
            floors = floors_while_reading(queue, root_fd, [f"f{i:03d}" for i in range(34, 134)])
            assert floors[-1] < fetch_us / 5, floors
        finally:
            os.close(root_fd)
