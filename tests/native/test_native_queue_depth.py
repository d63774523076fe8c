"""A root started at a depth its tier profile trusts (native/depthctl.c), on the simulator.

No ramp: the start holds where the tier serves that many fetches at once. Where it serves
fewer (fetch slots, an AFM gateway's threads), its windows bring the depth down to what was
served (Little's law), so reads wait in the daemon, where a more urgent file can overtake
them, not inside the file system.
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
