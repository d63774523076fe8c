"""The suite's router-like load: many small concurrent requests from several clients.

The llm-d router calls the daemon from every request it routes: small fire-and-forget
requests (one prompt's blocks: a few to a few dozen files) from several replicas at
once, never waiting for I/O. The clients are bench/loadgen.py's (separate processes,
one connection each, a seeded mix of `prefetch` of 1-64 files, `prefetch_blocks` and
`ping`); this scenario adds what the suite reports: a daemon of its own, the ack
latency in µs with its CDF, and the daemon's books checked against the clients' acks
after a drain: files accepted as the acks count them = files settled (read +
resident + missing + rejected + failed), and dropped as the acks say = dropped in
`stats`. `lost` (requests never answered) must be 0.

    .venv/bin/python bench/load.py --clients 8 --requests-per-client 10000 --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import loadgen
import machine
from warmup_daemon import EngineDaemon, start_engine_daemon

from kvharness.wire import RawConnection

SETTLED = ("read", "resident", "missing", "rejected", "failed")


def books(before: dict[str, Any], after: dict[str, Any], acks: dict[str, int]) -> dict[str, Any]:
    """The daemon's books over the run, against what the clients' acks said."""
    delta = {k: after["files"][k] - before["files"][k] for k in ("accepted", "dropped", *SETTLED)}
    settled = sum(delta[k] for k in SETTLED)
    return {
        "delta": delta,
        "in_flight_after_drain": after["files"]["in_flight"],
        "acks": acks,
        "balance": delta["accepted"] == settled == acks.get("accepted", 0)
        and delta["dropped"] == acks.get("dropped", 0) and after["files"]["in_flight"] == 0,
    }


def in_us(summary: dict[str, Any]) -> dict[str, Any]:
    """loadgen's latency summary (ms) in the suite's terms (µs, like ack_latency.py)."""
    def us(ms: float | None) -> float:
        return round((ms or 0.0) * 1000, 1)
    return {"n": summary["count"], "p50_us": us(summary["p50"]), "p99_us": us(summary["p99"]),
            "p999_us": us(summary["p999"]), "max_us": us(summary["max"]),
            "mean_us": us(summary["mean"]), "cdf_us": [[q, us(v)] for q, v in summary["cdf"]]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a daemon (or use --socket), run the clients, drain, check the books."""
    args.base.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ds = datasets.dataset(args.dataset, args.seed, args.base)
    paths = datasets.ensure(ds, quiet=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvload-"))
    daemon: EngineDaemon | None = None
    try:
        if args.socket:
            socket_path = args.socket
        else:  # queues as deep as the default's: a burst may drop (and count) files
            daemon = start_engine_daemon(args.engine, ds.root, 64 << 10, 0, args.workers,
                                         workdir, args.out)
            socket_path = daemon.socket
        with RawConnection(socket_path) as raw:
            before = raw.call_ok("stats")["stats"]
        result = loadgen.run_load(socket_path, args.clients, args.requests_per_client,
                                  paths=paths, layout=loadgen.blocks_layout(ds),
                                  pipeline=args.pipeline, seed=args.seed)
        drained = time.monotonic()
        after = loadgen.settle(socket_path)
        drain_s = time.monotonic() - drained
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    checked = books(before, after, result["files"])
    errors = [f"{code}: {count}" for code, count in result["errors"].items()]
    return {
        "benchmark": "router_load",
        "what": f"{args.clients} client processes at once, each on its own connection with "
                f"{args.pipeline} request(s) in flight: a seeded mix of small fire-and-forget "
                "prefetch (1-64 files), prefetch_blocks and ping",
        "argv": sys.argv,
        "machine": machine.description(),
        "settings": {"clients": args.clients, "requests_per_client": args.requests_per_client,
                     "pipeline": args.pipeline, "engine": args.engine, "workers": args.workers,
                     "mix": loadgen.DEFAULT_MIX, "dataset": ds.name, "seed": args.seed,
                     "daemon": "started" if daemon is not None else args.socket},
        "seconds": result["seconds"],
        "drain_s": round(drain_s, 3),
        "requests": args.clients * args.requests_per_client,
        "sent": result["sent"],
        "answered": result["answered"],
        "lost": args.clients * args.requests_per_client - result["answered"],
        "errors": errors + result["client_failures"],
        "requests_per_s": result["requests_per_s"] or 0.0,
        "latency": in_us(result["ack_ms"]),
        "per_op": {op: {k: v for k, v in in_us(s).items() if k != "cdf_us"}
                   for op, s in result["ack_ms_by_op"].items()},
        "files": result["files"],
        "books": checked,
        "books_balance": checked["balance"],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=10_000)
    parser.add_argument("--pipeline", type=int, default=1, help="requests in flight per client")
    parser.add_argument("--socket", default="",
                        help="an already running daemon (its roots must hold --base)")
    parser.add_argument("--engine", default="pread")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dataset", default="512x64KiB", help="the files prefetches name")
    parser.add_argument("--base", type=Path, default=datasets.DEFAULT_BASE)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quiet", action="store_true", help="no summary line at the end")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = run(args)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    if not args.quiet:
        lat = out["latency"]
        print(f"{out['requests']} requests from {args.clients} clients in {out['seconds']:.1f} s "
              f"({out['requests_per_s']:.0f}/s): answered {out['answered']}, lost {out['lost']}, "
              f"errors {out['errors']}; ack p50 {lat['p50_us']:.0f} µs, "
              f"p99 {lat['p99_us']:.0f} µs, p999 {lat['p999_us']:.0f} µs; "
              f"books balance: {out['books_balance']}")
    return 0 if out["lost"] == 0 and not out["errors"] and out["books_balance"] else 1


if __name__ == "__main__":
    sys.exit(main())
