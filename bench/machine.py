"""What else the machine is doing around a measurement: disk reads, drop_caches, busy CPU.

The machine is shared (other engineers' tests and benchmarks): a run is only worth
keeping when nobody else read the disk or dropped caches meanwhile, and the CPU
others used is reported beside each figure.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

import psutil


def disk_stat_path(path: str) -> Path | None:
    """/sys/dev/block/MAJ:MIN/stat of the device holding path (field 3: sectors read)."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def disk_read_bytes(stat: Path | None) -> int:
    if stat is None:
        return 0
    return int(stat.read_text().split()[2]) * 512  # sectors are always 512 bytes here


def drop_count() -> int:
    """How many times anyone wrote to drop_caches since boot (/proc/vmstat drop_pagecache).

    A drop by someone else during a measurement evicts what a method just warmed and
    makes the next page allocations pay host faults: such a run is void.
    """
    with open("/proc/vmstat") as handle:
        for line in handle:
            if line.startswith("drop_pagecache "):
                return int(line.split()[1])
    return 0


def wait_quiet(stat: Path | None, max_wait: float, expected_drops: int, *,
               window: float = 0.5, rate: float = 20e6, calm: float = 3.0) -> tuple[float, bool]:
    """Wait until the disk is idle (< rate bytes/s over window) and nobody dropped caches
    for `calm` s (this VM returns freed pages to the host 2-3 s after a drop).

    The machine is shared: other benchmarks may read the same disk in bursts. Returns
    (seconds waited, quiet reached); after max_wait it gives up and says so.
    expected_drops: the drop count after our own drop, whose settle is already over; a
    higher count means someone else dropped meanwhile, and calm starts from now.
    """
    started = time.monotonic()
    drops = drop_count()
    last_change = started if drops != expected_drops else started - calm
    while True:
        before = disk_read_bytes(stat)
        time.sleep(window)
        now = time.monotonic()
        if (current := drop_count()) != drops:
            drops, last_change = current, now
        idle = (disk_read_bytes(stat) - before) / window < rate
        if idle and now - last_change >= calm:
            return now - started, True
        if now - started >= max_wait:
            return now - started, False


def busy_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine (all CPUs): everything but idle and iowait."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0))



def children_cpu() -> float:
    """CPU seconds of this process's finished (waited-for) children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def description() -> dict[str, Any]:
    """The kernel, CPUs and load this run started with (every benchmark's "machine")."""
    return {"kernel": platform.release(), "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg()}


def run_header(benchmark: str, started: float) -> dict[str, Any]:
    """The first keys of a benchmark's results: what ran, when (`started`: time.time()
    at its start) and for how long."""
    return {"benchmark": benchmark, "argv": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
            "seconds": round(time.time() - started, 1)}
