"""One run of the router replay: a cold tier, the stream replayed against one method, measured.

Before the run the tier is made cold (the simulator's `evict-all`, which drops the mount's
page cache too; a real tier is remounted with its caches dropped) and the stream's warm
files are fetched. The clock then starts and one scheduler thread walks the stream's events
in time order: at a request's arrival its files go to the method (replay_methods.py); at
arrival + delta a consumer thread starts for it, which

reads the heads one file after another, as one loader thread does (its read time), and
between each open and that file's first read asks the tier how many bytes of the head it
will get without a fetch (`Tier.resident`, on the consumer's own fd: on the simulator its
st_blocks, which count fetched chunks exactly; on a real tier the page cache's mincore).
The warm-hit ratio is those bytes over the bytes it reads. The look is made through the
consumer's own open, not one of its own: on s3fs every open is a HEAD at the endpoint,
and an open by another process is what ends a warmer's hold (holds.py), so a look by
path both loaded the tier and undid the warm-up it was measuring.

Every consumer's start is checked against its due time (`late_s`): the harness's own lag,
reported so a loaded machine cannot pass for a slow method.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from percentiles import nearest_rank
from replay_methods import Clock, make, read_head
from replay_stream import Request, Stream

THREAD_STACK = 256 << 10
# Between the cold and the warm read of capacity(): past a FUSE mount's entry and attribute
# timeouts (1 s by default), so a warm open costs what a consumer's open of a file read
# seconds ago does.
WARM_AFTER_S = 1.5
PREWARM_THREADS = 64
ARRIVE, READ = 0, 1


class Tier(Protocol):
    root: Path

    def path(self, name: str) -> str: ...

    def cold(self) -> None: ...

    def resident(self, fd: int, head: int) -> int: ...

    def counters(self) -> dict[str, int]: ...

    def reset(self) -> None: ...


def parallel_read(paths: Sequence[str], head: int, threads: int) -> float:
    """Read the heads of `paths` with `threads` threads; the wall seconds."""
    jobs = list(paths)
    lock = threading.Lock()

    def work() -> None:
        buffer = bytearray(min(head, 1 << 20))
        while True:
            with lock:
                if not jobs:
                    return
                path = jobs.pop()
            read_head(path, head, buffer)

    started = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(min(threads, len(paths)) or 1)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return time.perf_counter() - started


def sequential_read(paths: Sequence[str], head: int,
                    look: Callable[[int], int] | None = None) -> tuple[float, int]:
    """Read the heads of `paths` one after another, as one loader thread does: the wall
    seconds, and the bytes `look` found near, given each fd between its open and its first
    read (0 without a look)."""
    buffer, near = bytearray(min(head, 1 << 20)), 0
    started = time.perf_counter()
    for path in paths:
        near += max(0, read_head(path, head, buffer, look))
    return time.perf_counter() - started, near


def capacity(tier: Tier, paths: Sequence[str], head: int, threads: int) -> dict[str, Any]:
    """The tier's rates, measured: `paths` cold, read by `threads` threads at once (files
    fetched a second), then the same again warm (files opened and read a second: on a
    tier where an open is a request to a server, this is what a consumer's reads of warm
    files cost it; replay_stream.py counts both into the load)."""
    tier.cold()
    before = tier.counters()
    wall = parallel_read(paths, head, threads)
    between = tier.counters()
    time.sleep(WARM_AFTER_S)
    warm = parallel_read(paths, head, threads)
    after = tier.counters()
    tier.cold()
    return {"files": len(paths), "threads": threads, "wall_s": round(wall, 4),
            "files_per_s": round(len(paths) / wall, 1),
            "tier": {k: between[k] - before.get(k, 0) for k in between},
            "warm_wall_s": round(warm, 4), "warm_files_per_s": round(len(paths) / warm, 1),
            "warm_tier": {k: after[k] - between.get(k, 0) for k in after}}


def references(tier: Tier, requests: Sequence[Request], head: int) -> dict[str, Any]:
    """The consumer's read time of one request alone, all cold and all warm (medians)."""
    tier.cold()
    cold, warm = [], []
    for request in requests:
        paths = [tier.path(f) for f in request.files]
        cold.append(sequential_read(paths, head)[0])
        warm.append(sequential_read(paths, head)[0])
    tier.cold()
    return {"requests": len(requests), "cold_s": sorted(cold)[len(cold) // 2],
            "warm_s": sorted(warm)[len(warm) // 2]}


def replay(stream: Stream, method: str, tier: Tier, head: int, workdir: Path,
           drain_s: float) -> dict[str, Any]:
    """One cold -> warm files -> stream run of `method`; per-request records and figures."""
    tier.cold()
    parallel_read([tier.path(f) for f in stream.warm], head, PREWARM_THREADS)
    tier.reset()  # a gauge's peak from here on
    previous = threading.stack_size(THREAD_STACK)
    clock = Clock()
    try:
        warmer = make(method, tier.root, head, workdir, clock)
    finally:
        threading.stack_size(previous)
    records: dict[int, dict[str, float]] = {}
    consumers: list[threading.Thread] = []
    try:
        counters0 = tier.counters()
        events = [(r.arrival_s, ARRIVE, r.index) for r in stream.requests]
        events += [(r.arrival_s + r.delta_s, READ, r.index) for r in stream.requests]
        heapq.heapify(events)
        threading.stack_size(THREAD_STACK)
        clock.start = time.monotonic()
        while events:
            due, kind, index = heapq.heappop(events)
            if (wait := due - clock.now()) > 0:
                time.sleep(wait)
            request = stream.requests[index]
            paths = [tier.path(f) for f in request.files]
            if kind == ARRIVE:
                warmer.submit(request, paths, clock.now())
                continue
            consumer = threading.Thread(target=consume, daemon=True,
                                        args=(request, paths, tier, head, clock, due, records))
            consumer.start()
            consumers.append(consumer)
        stream_s = clock.now()
        end = time.monotonic() + drain_s
        for consumer in consumers:
            consumer.join(max(0.0, end - time.monotonic()))
        warmer.finish(max(0.0, end - time.monotonic()))
        wall_s = clock.now()
        counters = tier.counters()
        done = warmer.results()
        detail = warmer.detail()
    finally:
        threading.stack_size(previous)
        warmer.close()
    return {"method": method, "load": stream.load, "stream_s": round(stream_s, 3),
            "wall_s": round(wall_s, 3), "unfinished_consumers": len(stream.requests) - len(records),
            "tier": {k: counters[k] - (0 if k.startswith("peak") else counters0.get(k, 0))
                     for k in counters},
            "detail": detail,
            "requests": per_request(stream, records, done)}


def consume(request: Request, paths: Sequence[str], tier: Tier, head: int, clock: Clock,
            due: float, records: dict[int, dict[str, float]]) -> None:
    """The GPU's loader for one request (module docstring)."""
    started = clock.now()

    def look(fd: int) -> int:
        return tier.resident(fd, head)

    read_s, warm = sequential_read(paths, head, look)
    records[request.index] = {"late_s": started - due, "warm_bytes": warm, "read_s": read_s}


def per_request(stream: Stream, records: dict[int, dict[str, float]],
                done: dict[int, tuple[float | None, bool]]) -> dict[str, list[Any]]:
    """Columns, one entry per request, in stream order (None where nothing was measured)."""
    columns: dict[str, list[Any]] = {k: [] for k in ("arrival_s", "delta_s", "new", "warm_bytes",
                                                     "read_s", "late_s", "warmup_s", "warmup_ok")}
    for request in stream.requests:
        record = records.get(request.index, {})
        completed, ok = done.get(request.index, (None, False))
        columns["arrival_s"].append(round(request.arrival_s, 4))
        columns["delta_s"].append(round(request.delta_s, 4))
        columns["new"].append(request.new)
        columns["warm_bytes"].append(record.get("warm_bytes"))
        columns["read_s"].append(_round(record.get("read_s")))
        columns["late_s"].append(_round(record.get("late_s")))
        columns["warmup_s"].append(_round(None if completed is None
                                          else completed - request.arrival_s))
        columns["warmup_ok"].append(ok)
    return columns


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


def summarize(run: dict[str, Any], request_bytes: int, latency_s: float) -> dict[str, Any]:
    """A run's figures: warm-hit ratios (all requests; those with delta >= 2x the fetch
    latency; those bringing new files), the share fully warm when read, warm-up completion
    (over the requests whose warm-up completed: `warmup_completed` says how many) and the
    share completed within delta, the consumer's read time, the harness's own lag.

    `fully_warm_new_by_bin`: [fully warm, requests] bringing new files, per BIN_S of the
    stream by arrival. In overload the tier's queue (the consumers' own fetches of what
    was not warmed are in it too) grows until no new file can be back within any delta:
    the bins show when that happened, so a count of fully warm requests can be read as
    what it is, mostly the stream's first seconds (docs/bench/replay.md)."""
    cols = run["requests"]
    rows = [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]
    read = [r for r in rows if r["warm_bytes"] is not None]
    long = [r for r in read if r["delta_s"] >= 2 * latency_s]
    new = [r for r in read if r["new"]]  # bringing files never asked for: a fetch is due

    def hit(subset: list[dict[str, Any]]) -> float | None:
        return round(sum(r["warm_bytes"] for r in subset) / (len(subset) * request_bytes), 4) \
            if subset else None

    def full(subset: list[dict[str, Any]]) -> float | None:
        return round(sum(r["warm_bytes"] >= request_bytes for r in subset) / len(subset), 4) \
            if subset else None

    warms = run["method"] != "none"
    # fully warm, and the warm-up done by the consumer's start: on s3fs each of its opens is
    # a HEAD queued behind the tier's backlog, so a consumer can find a file warm that was
    # fetched seconds after it was due (docs/bench/replay.md, "What the 150% count is made of")
    on_time_new = [r for r in new if r["warm_bytes"] >= request_bytes
                   and r["warmup_s"] is not None and r["warmup_s"] <= r["delta_s"]]
    warmups = sorted(r["warmup_s"] for r in rows if r["warmup_s"] is not None)
    reads = sorted(r["read_s"] for r in read)
    lates = sorted(r["late_s"] for r in read)
    on_time = sum(1 for r in rows if r["warmup_s"] is not None and r["warmup_s"] <= r["delta_s"])
    return {
        "requests": len(rows), "consumers_measured": len(read),
        "warm_hit": hit(read), "warm_hit_long_delta": hit(long), "long_delta_requests": len(long),
        "fully_warm": full(read), "fully_warm_long_delta": full(long),
        "new_requests": len(new), "warm_hit_new": hit(new), "fully_warm_new": full(new),
        "fully_warm_new_on_time": round(len(on_time_new) / len(new), 4) if new and warms
        else None,
        "warmup_p50_s": nearest_rank(warmups, 50), "warmup_p99_s": nearest_rank(warmups, 99),
        "warmup_completed": round(len(warmups) / len(rows), 4) if rows and warms else None,
        "warmup_on_time": round(on_time / len(rows), 4) if rows and warms else None,
        "read_p50_s": nearest_rank(reads, 50), "read_p99_s": nearest_rank(reads, 99),
        "read_mean_s": round(sum(reads) / len(reads), 5) if reads else None,
        "late_p99_s": nearest_rank(lates, 99),
        "fully_warm_new_by_bin": by_bin(new, request_bytes),
    }


BIN_S = 2.0  # summarize's bins of the stream, by arrival


def by_bin(new: list[dict[str, Any]], request_bytes: int) -> list[list[int]]:
    """[fully warm, requests] per BIN_S of arrival; [] for runs recorded before arrivals."""
    if not new or new[0].get("arrival_s") is None:
        return []
    bins = [[0, 0] for _ in range(int(max(r["arrival_s"] for r in new) // BIN_S) + 1)]
    for r in new:
        cell = bins[int(r["arrival_s"] // BIN_S)]
        cell[0] += r["warm_bytes"] >= request_bytes
        cell[1] += 1
    return bins
