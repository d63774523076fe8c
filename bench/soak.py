"""Soak: a million requests, and the daemon's memory and open fds sampled all along.

A leak that costs a few bytes or one fd per request is invisible in any test and
fatal after a week of routing. This runs bench/loadgen.py's router-like clients for
`--requests` requests in total (10^6 by default: minutes, not hours, on a 2-CPU VM)
and samples, every `--interval` seconds with psutil, the RSS and the open fds of the
supervisor and of each worker, plus the daemon's request count (its stats op).

After a warm-up (the first `--warmup` fraction of the samples: allocator arenas,
dedup tables, the books and the supervisor's per-worker buffers fill up to their
bounds; ~80 s at 4k requests/s here), RSS must not drift: the median of the last
fifth of the samples within +-5% of the median of the first fifth. A leak is a
drift; a single sample taken while a worker holds a full queue's backlog is not,
so "every sample within +-5% of the first" is reported beside it, not judged. The
JSON reports, per process and figure, first/last/min/max, the drift, the
least-squares slope (per hour, and per 10^5 requests); a worker that was replaced
mid-run is reported as such (its figures start over). Open fds are judged idle:
a worker holds its batch's files open while it reads them, so a sample mid-batch
sees a few more; a leak is an fd still open once the run is over and nothing is
in flight, so the idle counts before and after must be equal.

    .venv/bin/python bench/soak.py --out bench/out/soak                  # 10^6 requests
    .venv/bin/python bench/soak.py --requests 5000 --out /tmp/soak       # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import loadgen
import psutil

from kvharness.daemon import Daemon
from kvharness.wire import RawConnection

BAND = 0.05  # +-5% of the first sample after warm-up


class Sampler:
    """One connection held for the whole run, so it is one steady fd in the supervisor
    (a connection per sample would flicker: closed or not yet, when psutil counts)."""

    def __init__(self, socket_path: str, started: float) -> None:
        self.connection = RawConnection(socket_path, timeout=60)
        self.started = started

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.connection.call_ok("stats")["stats"]
        return stats

    def sample(self) -> dict[str, Any]:
        """The daemon's processes (pids from its stats) measured by psutil."""
        stats = self.stats()
        processes = {"supervisor": stats["supervisor"]["pid"]}
        processes.update({f"worker{w['index']}": w["pid"] for w in stats["workers"]})
        figures: dict[str, Any] = {}
        for name, pid in processes.items():
            try:
                process = psutil.Process(pid)
                with process.oneshot():
                    figures[name] = {"pid": pid, "rss_bytes": process.memory_info().rss,
                                     "open_fds": process.num_fds()}
            except psutil.Error:
                figures[name] = {"pid": pid, "rss_bytes": None, "open_fds": None}
        requests = sum(n for key, n in stats["requests"].items() if ":" in key)
        return {"t": round(time.perf_counter() - self.started, 3), "requests": requests,
                "connections": stats["connections"], "in_flight": stats["files"]["in_flight"],
                "processes": figures}

    def close(self) -> None:
        self.connection.close()


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys over xs; None with fewer than two distinct xs."""
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def judge(samples: Sequence[dict[str, Any]], warmup: float) -> dict[str, Any]:
    """Per process and figure: first/last/min/max after warm-up, slope, within the band.

    Judged are the samples after warm-up taken while every client was connected (the
    most connections seen): clients finish at different times, and each one gone takes
    its connection's fd with it, which is no leak.
    """
    skip = min(len(samples) - 1, int(len(samples) * warmup)) if samples else 0
    most = max((s["connections"] for s in samples), default=0)
    steady = [s for s in samples[skip:] if s["connections"] == most]
    names = sorted({name for s in samples for name in s["processes"]})
    report: dict[str, Any] = {}
    for name in names:
        rows = [s for s in steady if name in s["processes"]]
        pids = sorted({s["processes"][name]["pid"] for s in rows})
        if len(pids) > 1:  # replaced mid-run: judge the last incarnation only
            rows = [s for s in rows if s["processes"][name]["pid"] == pids[-1]]
        entry: dict[str, Any] = {"pids": pids, "replaced": len(pids) > 1}
        for figure in ("rss_bytes", "open_fds"):
            points = [(s["t"], s["requests"], s["processes"][name][figure]) for s in rows
                      if s["processes"][name][figure] is not None]
            if not points:
                entry[figure] = None
                continue
            values = [v for _, _, v in points]
            first = values[0]
            fifth = max(1, len(values) // 5)
            start, end = statistics.median(values[:fifth]), statistics.median(values[-fifth:])
            drift = (end - start) / start * 100 if start else 0.0
            per_second = slope([t for t, _, _ in points], values)
            per_request = slope([r for _, r, _ in points], values)
            entry[figure] = {
                "first": first, "last": values[-1], "min": min(values), "max": max(values),
                "slope_per_hour": None if per_second is None else round(per_second * 3600, 1),
                "slope_per_100k_requests": None if per_request is None
                else round(per_request * 1e5, 3),
                "change_pct": round((values[-1] - first) / first * 100, 2) if first else None,
                "drift_pct": round(drift, 2), "flat": abs(drift) <= BAND * 100,
                "every_sample_within_5pct": all(abs(v - first) <= BAND * first for v in values),
            }
        report[name] = entry
    return {"warmup_samples": skip, "steady_samples": len(steady), "connections": most,
            "processes": report,
            "rss_flat": all(e["rss_bytes"] is None or e["rss_bytes"]["flat"]
                            for e in report.values())}


def idle_fds(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Open fds per process with no client connected and nothing in flight, before and
    after the run: equal, or something leaked one (a replaced worker is not compared)."""
    out: dict[str, Any] = {}
    for name, was in before["processes"].items():
        now = after["processes"].get(name, {})
        same_pid = now.get("pid") == was["pid"]
        out[name] = {"before": was["open_fds"], "after": now.get("open_fds"),
                     "returned": not same_pid or now.get("open_fds") == was["open_fds"]}
    return out


def run_soak(socket_path: str, *, requests: int, clients: int, paths: Sequence[str],
             layout: dict[str, Any] | None, interval: float, warmup: float,
             pipeline: int = 1, seed: int = 1) -> dict[str, Any]:
    """Drive `requests` requests over `clients` processes while sampling; the figures."""
    per_client = max(1, requests // clients)
    plans = loadgen.plans_for(socket_path, paths, clients=clients,
                              requests_per_client=per_client, paths_per_request=(1, 64),
                              mix=loadgen.DEFAULT_MIX, pipeline=pipeline, seed=seed,
                              layout=layout, idle_timeout=120.0)
    started = time.perf_counter()
    sampler = Sampler(socket_path, started)
    try:
        before = sampler.sample()
        samples: list[dict[str, Any]] = []
        run = loadgen.LoadRun(plans)
        results = run.wait(lambda: samples.append(sampler.sample()), interval)
        stats = loadgen.settle(socket_path)
        # Judged: the samples taken while the clients ran. Before and after (no client
        # connected, no request queued) are reported beside them: fewer fds is no leak.
        after = sampler.sample()
    finally:
        sampler.close()
    steady = judge(samples, warmup)
    fds = idle_fds(before, after)
    return {"requests": per_client * clients, "load": loadgen.summarize(results, run.seconds),
            "duration_s": round(time.perf_counter() - started, 1),
            "books": loadgen.books_balance(stats), "worker_restarts": stats["worker_restarts"],
            "flat": steady["rss_flat"] and all(f["returned"] for f in fds.values()),
            "steady": steady, "idle_fds": fds, "idle_before": before, "idle_after": after,
            "samples": samples}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000, help="in total")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.3,
                        help="fraction of the samples left out before judging flatness")
    parser.add_argument("--socket", help="an existing daemon (default: start one on --dataset)")
    parser.add_argument("--dataset", default="2000x64KiB", help="COUNTxSIZE (bench/datasets.py)")
    parser.add_argument("--base", type=Path, default=datasets.DEFAULT_BASE)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    ds = datasets.dataset(args.dataset, base=args.base)
    paths = datasets.ensure(ds, quiet=True)
    daemon: Daemon | None = None
    socket_path = args.socket
    if socket_path is None:
        daemon = loadgen.own_daemon(ds.root, Path(tempfile.mkdtemp(prefix="kvsoak-")),
                                    args.workers)
        socket_path = daemon.socket_path
    try:
        result = run_soak(socket_path, requests=args.requests, clients=args.clients,
                          paths=paths, layout=loadgen.blocks_layout(ds), interval=args.interval,
                          warmup=args.warmup)
    finally:
        if daemon is not None:
            daemon.stop()
    result["setup"] = {"dataset": ds.name, "socket": socket_path, "own_daemon": daemon is not None,
                       "clients": args.clients, "workers": args.workers,
                       "interval_s": args.interval, "warmup_fraction": args.warmup,
                       "host": platform.node(), "cpus": os.cpu_count(),
                       "kernel": platform.release(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    steady, figures = result["steady"], result["load"]
    print(f"{figures['answered']}/{figures['sent']} answered in {result['duration_s']} s, lost "
          f"{figures['lost']}; RSS drift within 5%: {steady['rss_flat']}, idle fds returned: "
          f"{all(f['returned'] for f in result['idle_fds'].values())} -> "
          f"{args.out / 'soak.json'}")
    for name, entry in steady["processes"].items():
        for figure in ("rss_bytes", "open_fds"):
            f = entry[figure]
            if f is not None:
                print(f"  {name:10} {figure:9} first {f['first']} last {f['last']} "
                      f"max {f['max']} drift {f['drift_pct']}% slope/h {f['slope_per_hour']} "
                      f"every sample in band {f['every_sample_within_5pct']}")
    return 0 if figures["lost"] == 0 and result["books"]["balanced"] else 1


if __name__ == "__main__":
    sys.exit(main())
