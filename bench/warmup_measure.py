"""One measured run: make the set cold (or warm), warm it up, read its residency, consume.

After each warm-up a *consumer* preads every head in one thread, timed: warm-up +
consumer read is what a reader of the files sees. Around the run, what may have
disturbed it is recorded (machine.py): someone else's drop_caches, disk reads the
method's own pages do not account for, a disk that never went quiet.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cold
import psutil
from machine import busy_cpu_seconds, children_cpu, disk_read_bytes, drop_count, wait_quiet
from warmup_methods import BASELINE, Env, warm
from warmup_tools import DEVICE_REFERENCE

from kvharness.pagecache import Pin, cached_and_reclaimed, pinned


def own_cpu(env: Env) -> float:
    """CPU seconds of this process, its finished children and the daemons we started."""
    me = psutil.Process().cpu_times()
    total = me.user + me.system + children_cpu()
    for daemon in env.daemons.values():
        workers, supervisor = daemon.cpu()
        total += workers + supervisor
    return float(total)



def consume(paths: Sequence[str], head: int) -> tuple[float, int]:
    """The reader: one thread, open + pread [0, head) + close per file, no hints. Timed."""
    buf = bytearray(head)
    view = memoryview(buf)
    total = 0
    started = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            offset = 0
            while offset < head:
                n = os.preadv(fd, [view[offset:]], offset)
                if n <= 0:
                    break
                offset += n
            total += offset
        finally:
            os.close(fd)
    return time.perf_counter() - started, total


def residency_profile(paths: Sequence[str], head: int) -> dict[str, Any]:
    """Per-file means of whole-file and head residency (cachestat, so reads in flight
    count), and of what the host's reclaimer took back after it was cached."""
    started = time.perf_counter()
    whole = in_head = size = whole_reclaimed = head_reclaimed = 0
    for path in paths:
        size += os.stat(path).st_size
        resident, reclaimed = cached_and_reclaimed(path)
        whole, whole_reclaimed = whole + resident, whole_reclaimed + reclaimed
        resident, reclaimed = cached_and_reclaimed(path, 0, head)
        in_head, head_reclaimed = in_head + resident, head_reclaimed + reclaimed
    count = max(1, len(paths))
    return {
        "sampled_files": len(paths),
        "whole_file_bytes_per_file": whole / count,
        "head_bytes_per_file": in_head / count,
        "whole_file_reclaimed_bytes_per_file": whole_reclaimed / count,
        "head_reclaimed_bytes_per_file": head_reclaimed / count,
        "file_bytes_per_file": size / count,
        "seconds": round(time.perf_counter() - started, 4),
    }


SLACK_BYTES = 32 << 20  # metadata (directory and inode blocks) and stray reads


def measure(env: Env, method: str, args: argparse.Namespace, stat: Path | None,
            sample: Sequence[str], rep: int) -> dict[str, Any]:
    """One cold -> warm-up -> residency -> consumer sequence, with what may have disturbed it.

    `interference` lists reasons to distrust the run: a drop_caches by someone else
    between the warm-up's start and the consumer's end, or the disk reading far more
    than this method's own pages account for (another process reading).

    The warm state's heads are read and mlocked for the whole run (pagecache.pinned):
    the host's reclaimer and others' drop_caches cannot take one before the method looks.
    """
    if env.state == "cold":
        return measure_run(env, method, args, stat, sample, rep, None)
    with pinned(env.paths, env.head) as pin:
        return measure_run(env, method, args, stat, sample, rep, pin)


def measure_run(env: Env, method: str, args: argparse.Namespace, stat: Path | None,
                sample: Sequence[str], rep: int, pin: Pin | None) -> dict[str, Any]:
    files = len(env.paths)
    own = drop_count()
    if pin is None:
        report = cold.make_cold(env.paths, args.cold, args.settle, 64, args.seed + rep)
        own += report.method.startswith("drop")
        prepared, prepared_report = report.cold, report.as_dict()
    else:
        prepared_report = held_resident(pin, env.head, sample)
        prepared = prepared_report["resident"]
    waited, quiet = wait_quiet(stat, args.quiet_wait, own) if args.quiet_wait > 0 \
        else (0.0, True)
    drops0 = drop_count()
    disk0, busy0, own0 = disk_read_bytes(stat), busy_cpu_seconds(), own_cpu(env)
    if method == BASELINE:
        result: dict[str, Any] = {"seconds": None, "cpu_s": None, "detail": {}, "ok": True}
    else:
        result = warm(env, method)
    disk1, busy1, own1 = disk_read_bytes(stat), busy_cpu_seconds(), own_cpu(env)
    resident = residency_profile(sample, env.head) if method != BASELINE else None
    consumer_s, consumed = consume(env.paths, env.head)
    disk2 = disk_read_bytes(stat)
    if resident is None:
        resident = residency_profile(sample, env.head)
    drops = drop_count() - drops0
    interference = []
    if drops:
        interference.append(f"{drops} drop_caches by someone else")
    brought = resident["whole_file_bytes_per_file"] * files
    # O_DIRECT caches nothing by design: its disk reads are no one else's
    slack = SLACK_BYTES * (1 + files // 10000)
    if method not in (BASELINE, DEVICE_REFERENCE) and disk1 - disk0 > 1.5 * brought + slack:
        interference.append(f"disk read {(disk1 - disk0) / 1e6:.0f} MB during the warm-up, "
                            f"{brought / 1e6:.0f} MB of it cached")
    missing = (env.head - resident["head_bytes_per_file"]) * files if method != BASELINE \
        else brought
    if disk2 - disk1 > 1.5 * missing + SLACK_BYTES * (1 + files // 10000):
        interference.append(f"disk read {(disk2 - disk1) / 1e6:.0f} MB during the consumer "
                            f"read, {missing / 1e6:.0f} MB expected")
    if not quiet:
        interference.append(f"the disk or drop_caches never went quiet in {waited:.0f} s")
    return {
        "rep": rep,
        "state": env.state,
        # the set was verified cold (or, in the warm state, resident) before the method
        "cold": prepared if env.state == "cold" else False,
        "prepared": prepared,
        "mlocked": len(pin.locked) if pin else 0,  # heads no reclaimer could take
        "cold_report": prepared_report,
        "waited_for_quiet_s": round(waited, 2),
        "warm_s": result["seconds"],
        "consumer_s": consumer_s,
        "total_s": (result["seconds"] or 0.0) + consumer_s,
        "cpu_s": result["cpu_s"],
        "machine_busy_cpu_s": round(busy1 - busy0, 3),
        # CPU others used meanwhile (pytest runs, other benchmarks): not retried, but shown
        "foreign_cpu_s": round(max(0.0, (busy1 - busy0) - (own1 - own0)), 3),
        "disk_read_bytes": disk1 - disk0,
        "consumer_disk_read_bytes": disk2 - disk1,
        "resident": resident,
        "interference": interference,
        "ok": bool(result["ok"]) and prepared and consumed == files * env.head,
        "detail": result["detail"],
    }


def held_resident(pin: Pin, head: int, sample: Sequence[str]) -> dict[str, Any]:
    """The warm state, as pinned (every head read and mlocked), verified on the sample.
    Where mlock is refused the heads are only mapped: `kept` counts the ones still whole."""
    started = time.monotonic()
    kept = len(pin.kept())
    profile = residency_profile(sample, head)
    return {"method": "pinned", "seconds": round(time.monotonic() - started, 3),
            "mlocked": len(pin.locked), "kept": kept, "why_not_locked": pin.why,
            "sampled_files": profile["sampled_files"],
            "head_bytes_per_file": profile["head_bytes_per_file"],
            "resident": kept == len(pin.paths)}
