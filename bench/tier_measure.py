"""One measured run on the slow tier: make it cold, warm it up, and ask the tier what happened.

Cold means the simulator's `evict-all` (every fetched chunk forgotten, the kernel's pages
of the mount dropped) and its counters reset, before every method. The run then records
the method's wall time and, from the simulator, how many chunks it fetched and how many
fetches were in flight at the peak; and from st_blocks (which counts fetched chunks on
the simulator) whether every file's head was fetched. The heads' page-cache residency
is read on a sample too: a method may fetch a chunk yet leave only part of it cached
(on FUSE, fadvise(WILLNEED) brings in one readahead window: tiersim/README.md).

The backing files are kept in the page cache: a fetch reads its chunk from them, and a
backing page the host reclaimed would add a disk read to the tier's latency. Whatever
had to be read again is counted (`backing_reread_bytes`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from machine import busy_cpu_seconds
from warmup_measure import own_cpu
from warmup_methods import BASELINE, Env, warm

import tiersim
from kvharness.daemon import cpu_seconds
from kvharness.pagecache import residency

BLOCK = 512  # st_blocks' unit (stat(2))
COUNTERS = ("fetches", "fetched_bytes", "reads", "read_bytes", "read_errors", "peak_in_flight",
            "queued", "pending_reads")


def keep_backing_warm(paths: Sequence[str]) -> int:
    """Read again every backing file not wholly in the page cache; the bytes read."""
    reread = 0
    for path in paths:
        resident, size = residency(path)
        if resident < size:
            with open(path, "rb", buffering=0) as handle:
                while chunk := handle.read(1 << 20):
                    reread += len(chunk)
    return reread


def span_fetched(path: str, span: int) -> bool:
    """The chunks covering [0, span) were fetched: st_blocks counts fetched chunks."""
    return os.stat(path).st_blocks * BLOCK >= span


def expected_span(method: str, head: int, file_bytes: int, chunk: int, whole: bool) -> int:
    """The bytes of fetched chunks a method's warm-up leaves per file: its head (or the
    whole file) rounded up to chunks, at most the file."""
    if method == BASELINE:
        return 0
    wanted = file_bytes if whole else head
    return min(file_bytes, -(-wanted // chunk) * chunk)


def measure(env: Env, tier: tiersim.Tier, method: str, backing: Sequence[str],
            file_bytes: int, whole: bool, sample: Sequence[str]) -> dict[str, Any]:
    """One evict -> warm-up -> counters sequence of `method` at the tier's current setting."""
    files, chunk = len(env.paths), tier.options.chunk_bytes
    reread = keep_backing_warm(backing)
    tier.evict_all()
    tier.reset_stats()
    assert tier.process is not None
    sim0, busy0, own0 = cpu_seconds(tier.process.pid), busy_cpu_seconds(), own_cpu(env)
    if method == BASELINE:
        result: dict[str, Any] = {"seconds": None, "cpu_s": None, "detail": {}, "ok": True}
    else:
        result = warm(env, method)
    stats = tier.stats()
    sim1, busy1, own1 = cpu_seconds(tier.process.pid), busy_cpu_seconds(), own_cpu(env)
    span = expected_span(method, env.head, file_bytes, chunk, whole)
    heads = sum(1 for path in env.paths if span_fetched(path, max(span, 1)))
    expected_fetches = files * -(-span // chunk)
    cached = sum(residency(path, 0, env.head)[0] for path in sample)
    fetched_as_expected = (stats.fetches == expected_fetches and stats.read_errors == 0
                           and heads == (files if span else 0))
    return {
        "method": method,
        "wall_s": result["seconds"],
        "ok": bool(result["ok"]) and fetched_as_expected,
        "tier": {name: getattr(stats, name) for name in COUNTERS},
        "expected_fetches": expected_fetches,
        "files_fetched": heads,
        "fetched_as_expected": fetched_as_expected,
        "head_cached_fraction": cached / (len(sample) * env.head) if sample else None,
        "cpu_s": result["cpu_s"],
        "simulator_cpu_s": round(sim1 - sim0, 3),
        # CPU others used meanwhile (the machine is shared): shown, never corrected for
        "foreign_cpu_s": round(max(0.0, (busy1 - busy0) - (own1 - own0) - (sim1 - sim0)), 3),
        "backing_reread_bytes": reread,
        "detail": result["detail"],
    }
