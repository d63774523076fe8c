"""The `stats` reply, assembled in one place from the rooms that keep the figures.

The schema is kvprefetch.stats (the client package's, so the CLI and the daemon read
and write the same types); the `stats` op returns this, and the Prometheus exposition
renders exactly this.
"""

from __future__ import annotations

import os
import time
from typing import cast

import psutil

import kvprefetchd
from kvprefetch.stats import (
    BoundStats,
    FileCounts,
    ProcessFigures,
    QueueStats,
    Stats,
    WorkerStats,
)
from kvprefetchd.listeners.connection import FREE_INPUT_BYTES
from kvprefetchd.listeners.peers import PRIVILEGED_RESERVE
from kvprefetchd.listeners.server import Server
from kvprefetchd.ops.handlers import Ops
from kvprefetchd.ops.kvservice import KVService
from kvprefetchd.roots.rootset import RootSet
from kvprefetchd.roots.scout import Scout
from kvprefetchd.supervisor.books import Books
from kvprefetchd.supervisor.handle import WorkerHandle
from kvprefetchd.supervisor.pool import WorkerPool
from kvprefetchd.supervisor.stuck import Stuck
from kvprefetchd.worker.holds import RELEASES


def process_figures(pid: int) -> ProcessFigures:
    """RSS, CPU seconds and open fds of a process (psutil); empty once it is gone."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            cpu = process.cpu_times()
            return {
                "rss_bytes": process.memory_info().rss,
                "cpu_seconds": round(cpu.user + cpu.system, 3),
                "open_fds": process.num_fds(),
            }
    except psutil.Error:
        return {}


def build_stats(
    *, started: float, warm_mode: str, ops: Ops, pool: WorkerPool, books: Books,
    server: Server, kv: KVService, roots: RootSet, stuck: Stuck, scout: Scout,
    events: dict[str, int],
) -> Stats:
    return {
        "uptime_s": round(time.monotonic() - started, 3),
        "version": kvprefetchd.__version__,
        "engine": pool.engine_name,
        "warm_mode": warm_mode,
        "requests": dict(ops.requests),
        "events": {**events, **pool.events},
        "files": file_counts(books),
        "bytes_read": books.bytes_read,
        "kv": kv.stats(),
        "latency": {
            "ack_seconds": ops.ack_latency.snapshot(),
            "wait_seconds": ops.wait_latency.snapshot(),
            "file_seconds": pool.file_latency.snapshot(),
        },
        "worker_restarts": pool.restarts,
        "workers_killed_wedged": pool.killed_wedged,
        "supervisor": {"pid": os.getpid(), **process_figures(os.getpid())},
        "connections": len(server.connections),
        "bounds": bounds(ops, pool, server, kv),
        "roots": roots.stats(),
        "scout": {"tasks": scout.counts["tasks"], "timeouts": scout.counts["timeouts"],
                  "restarts": scout.counts["restarts"]},
        "stuck": stuck.report(),
        "workers": [worker_stats(handle, pool) for handle in pool.workers if handle],
    }


def bounds(ops: Ops, pool: WorkerPool, server: Server, kv: KVService) -> dict[str, BoundStats]:
    """Every bounded buffer and per-key map of the supervisor, by name: size and limit."""
    config = server.config
    slots = config.max_connections + PRIVILEGED_RESERVE
    connections = server.connections.values()
    # A deadline entry per open waiter, and as many again answered early (ops.py); there
    # are at most as many open waiters as files in flight.
    open_waiters = pool.config.queue_limit * pool.config.worker_count
    figures = {
        "connections": (len(server.connections), slots),
        "input_pool_bytes": (server.input_pool.granted, server.input_pool.limit),
        "input_bytes": (sum(c.frames.buffered for c in connections),
                        server.input_pool.limit + FREE_INPUT_BYTES * slots),
        "output_bytes": (sum(len(c.output) for c in connections),
                         2 * config.max_output_bytes * slots),
        "deadlines": (ops.deadlines, 2 * open_waiters + 64),
        **kv.bounds(),
    }
    return {name: {"size": size, "limit": limit} for name, (size, limit) in figures.items()}


def file_counts(books: Books) -> FileCounts:
    totals = books.totals
    return {
        "accepted": totals["accepted"],
        "dropped": totals["dropped"],
        "rejected_by_supervisor": totals["rejected_by_supervisor"],
        "read": totals["read"],
        "resident": totals["resident"],
        "missing": totals["missing"],
        "rejected": totals["rejected"],
        "failed": totals["failed"],
        "expired": totals["expired"],
        "futile": totals["futile"],
        "expired_replies": totals["expired_replies"],
        "in_flight": books.in_flight(),
    }


def worker_stats(handle: WorkerHandle, pool: WorkerPool) -> WorkerStats:
    owes = pool.books.outstanding(handle.index)
    figures: WorkerStats = {
        **process_figures(handle.pid),
        "index": handle.index,
        "pid": handle.pid,
        "ready": handle.ready,
        "engine": handle.engine,
        "queue_depth": owes,
        "queue_limit": pool.config.queue_limit,
        "restarts": handle.restarts,
        # The heartbeat, observable: seconds without a report while owing outcomes.
        "silent_s": round(time.monotonic() - handle.heard, 3) if owes else 0.0,
        "batches": handle.counters["batches"],
        "batches_other_mode": handle.counters["batches_other_mode"],
        "dedup_recent": handle.counters["dedup_recent"],
        "dedup_in_flight": handle.counters["dedup_in_flight"],
        "probed_resident": handle.counters["probed_resident"],
        "probed_missing": handle.counters["probed_missing"],
        "held_total": handle.counters["held_total"],
        "hold_released": {why: handle.counters[f"hold_released_{why}"] for why in RELEASES},
        "hold_refused": handle.counters["hold_refused"],
        "queue": cast(QueueStats, handle.queue),
    }
    return figures
