"""kvprefetchd as a warm-up method: one daemon per (engine, workers), and its warm-up.

Each daemon is started once and reused for every repetition. The paths go as
pipelined `prefetch` requests with `wait` on one connection (warmup.py --chunk-paths),
through the `kvprefetch` client when it is importable, else the raw speaker.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvharness.daemon import Daemon, start_config
from kvharness.wire import RawConnection

# (socket, paths, head, chunk_paths) -> the `wait` replies
Prefetch = Callable[[str, Sequence[str], int, int], list[dict[str, Any]]]

# The warm state's heads are mlocked for the run (warmup_measure.measure): none can go.
# Where mlock is refused (no CAP_IPC_LOCK, RLIMIT_MEMLOCK too small) they are only mapped,
# and the host's reclaimer may take a few between the check and the request (pages read
# once can go within seconds here): the daemon then rightly reads them again. Up to this
# share of such re-reads still makes a clean run (the tests hold mlocked runs to none).
WARM_REREAD_TOLERANCE = 0.03


@dataclass
class EngineDaemon:
    """A daemon running one engine, with its worker pids known once (a measurement
    then reads their CPU time without asking the supervisor for `stats`)."""

    engine: str
    workers: int
    daemon: Daemon
    worker_pids: list[int]
    running: str = ""  # the engine the daemon reports running (what "auto" chose)

    @property
    def socket(self) -> str:
        return self.daemon.socket_path

    def stats(self) -> dict[str, Any]:
        return self.daemon.stats()

    def cpu(self) -> tuple[float, float]:
        """(workers, supervisor) CPU seconds so far, every thread included."""
        return self.daemon.cpu(self.worker_pids)

    def stop(self) -> None:
        self.daemon.stop()


def start_engine_daemon(engine: str, root: Path, head: int, files: int, workers: int,
                        workdir: Path, logdir: Path, *, dedup: bool = True,
                        name: str = "", extra: Mapping[str, Any] | None = None) -> EngineDaemon:
    """One daemon for one engine, configured so a whole set fits in its queues.

    queue_limit is per worker and 8192 by default: a burst of 20,000 files over two
    workers would drop ~1,800 files, which measures the queue, not the warm-up.
    dedup=False turns the worker's memory of recently warmed files off, so a request
    for resident files pays the real residency check every time (the warm state).
    extra: further settings (warm_mode, residency, ...); name: the daemon's file names.
    engine "auto" runs whatever the daemon chooses: `running` says what (from ping).
    """
    name = name or f"{engine}-{workers}w"
    settings: dict[str, Any] = {
        "roots": [str(root)],
        "workers": workers,
        "engine": engine,
        "read_bytes": head,
        "max_read_bytes": max(head, 64 << 20),
        "queue_limit": max(8192, files + 1024),
        "max_paths_per_request": max(100_000, files),
        **({} if dedup else {"dedup_ttl_ms": 0}),
        **(extra or {}),
        # For experiments: settings of the daemon's own, as a JSON map (bench/README.md).
        **json.loads(os.environ.get("KVBENCH_DAEMON_SETTINGS") or "{}"),
    }
    daemon = start_config(workdir, settings, name=f"kvp-{name}",
                          log_path=logdir / f"daemon-{name}.log", new_session=True)
    running = str(daemon.call("ping").get("engine"))
    if engine != "auto" and running != engine:
        daemon.stop()
        raise RuntimeError(f"asked for engine {engine}, daemon runs {running}")
    return EngineDaemon(engine, workers, daemon, daemon.worker_pids(), running)


def make_prefetcher(kind: str) -> tuple[str, Prefetch]:
    """The client that sends the warm-up: the `kvprefetch` package, else the raw speaker."""
    if kind in ("auto", "kvprefetch"):
        try:
            from kvprefetch import Client

            def with_client(sock: str, paths: Sequence[str], head: int,
                            chunk: int) -> list[dict[str, Any]]:
                step = chunk or max(1, len(paths))
                batches = [paths[i : i + step] for i in range(0, len(paths), step)]
                with Client(sock, timeout=None) as client:
                    results = client.prefetch_many(batches, wait=True, read_bytes=head)
                return [{"accepted": r.accepted, "dropped": r.dropped, "rejected": r.rejected,
                         "outcomes": r.outcomes or {}, "elapsed_us": r.elapsed_us or 0}
                        for r in results]

            return "kvprefetch", with_client
        except ImportError:
            if kind == "kvprefetch":
                raise

    def with_raw(sock: str, paths: Sequence[str], head: int,
                 chunk: int) -> list[dict[str, Any]]:
        with RawConnection(sock, timeout=None) as raw:
            return raw.prefetch_wait(paths, head, chunk)

    return "raw", with_raw


def warm_daemon(daemon: EngineDaemon, prefetch: Prefetch, paths: Sequence[str], head: int,
                chunk_paths: int, state: str) -> dict[str, Any]:
    stats0 = daemon.stats()
    workers0, super0 = daemon.cpu()
    started = time.perf_counter()
    replies = prefetch(daemon.socket, paths, head, chunk_paths)
    wall = time.perf_counter() - started
    workers1, super1 = daemon.cpu()
    stats1 = daemon.stats()
    outcomes: dict[str, int] = {}
    for reply in replies:
        for name, count in reply.get("outcomes", {}).items():
            outcomes[name] = outcomes.get(name, 0) + count
    dropped = sum(r["dropped"] for r in replies)
    rejected = sum(r["rejected"] for r in replies)
    return {
        "seconds": wall,
        "cpu_s": (workers1 - workers0) + (super1 - super0),
        "detail": {
            "workers_cpu_s": round(workers1 - workers0, 4),
            "supervisor_cpu_s": round(super1 - super0, 4),
            "requests": len(replies),
            "daemon_elapsed_s_max": max(r.get("elapsed_us", 0) for r in replies) / 1e6,
            "outcomes": outcomes,
            "dropped": dropped,
            "rejected": rejected,
            "bytes_read": stats1["bytes_read"] - stats0["bytes_read"],
        },
        "ok": dropped == 0 and rejected == 0
        and settled_as_expected(state, len(paths), outcomes),
    }


def settled_as_expected(state: str, files: int, outcomes: dict[str, int]) -> bool:
    """Cold: every head read. Warm: every head found resident and skipped, but for the
    few the reclaimer took meanwhile, which are read."""
    if state == "cold":
        return outcomes.get("read", 0) == files
    resident, read = outcomes.get("resident", 0), outcomes.get("read", 0)
    return resident + read == files and read <= WARM_REREAD_TOLERANCE * files
