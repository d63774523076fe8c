"""A router-like load: many small concurrent requests from several clients at once.

The llm-d router calls the daemon from every request it routes: small fire-and-forget
requests (the blocks of one prompt: a few to a few dozen files), from several router
replicas or goroutines at once, never waiting for I/O. This runs that shape against a
real daemon and records what each caller sees: the ack latency of every request, and
whether every request was answered.

Each client is its own process (fork) with its own connection, closed loop (one request
in flight, as a PreRequest hook), sending a seeded mix:
- 80% `prefetch` of 1-64 paths (log-uniform: most requests are short prompts), half of
  them existing files of a small KV-layout set (so workers read, then find them
  resident or remembered), half files not written yet (`missing`);
- 12% `prefetch_blocks` with 4-48 block hashes the router computed, inline profile;
- 8% `ping` (a health check).
Requests go as fast as the replies come: the load is the most the clients can offer.

Afterwards the daemon's queues are drained and its books checked: files accepted as
the clients' acks count them = files settled (read + resident + missing + rejected +
failed), and dropped as the acks say = dropped in `stats`. `lost` counts requests sent
and never answered (a closed connection, a timeout): it must be 0.

    .venv/bin/python bench/load.py --clients 8 --requests-per-client 10000 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ack_latency
import datasets
import kvproto
from warmup import Daemon, start_daemon

MIX = (("prefetch", 0.80), ("prefetch_blocks", 0.12), ("ping", 0.08))
HASH = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
        "vllm_version": "0.23.0"}
SETTLED = ("read", "resident", "missing", "rejected", "failed")
CLIENT_TIMEOUT_S = 30.0


def layout(root: Path) -> dict[str, Any]:
    """An inline profile: where the router's block hashes map to (spec/kv-file-layout.md)."""
    return {"root_dir": str(root), "model_name": "org/model", "tp_size": 1,
            "kv_cache_groups": [{"block_size": 16}], "connector_block_size_tokens": 16,
            "fingerprint": "0123456789ab"}


def path_count(rng: random.Random) -> int:
    """1..64, log-uniform."""
    return min(64, int(math.exp(rng.uniform(0.0, math.log(65)))))


def client(index: int, socket_path: str, requests: int, existing: Sequence[str],
           missing: Sequence[str], root: str, seed: int, start_at: float,
           conn: Any) -> None:
    """One router replica: its own connection, closed loop; reports through conn."""
    rng = random.Random(seed * 1000 + index)
    ops = [op for op, _ in MIX]
    weights = [w for _, w in MIX]
    profile = layout(Path(root))
    latencies: dict[str, list[int]] = {op: [] for op in ops}
    accepted = dropped = answered = 0
    errors: list[str] = []
    try:
        raw = kvproto.RawClient(socket_path, timeout=CLIENT_TIMEOUT_S)
    except OSError as error:
        conn.send({"index": index, "answered": 0, "errors": [f"connect: {error}"],
                   "latencies": latencies, "accepted": 0, "dropped": 0})
        return
    while time.time() < start_at:  # every client starts at once
        time.sleep(0.001)
    try:
        for _ in range(requests):
            op = rng.choices(ops, weights)[0]
            if op == "prefetch":
                pool = existing if rng.random() < 0.5 else missing
                fields: dict[str, Any] = {"paths": rng.sample(pool, path_count(rng))}
            elif op == "prefetch_blocks":
                fields = {"hash": HASH, "layout": profile,
                          "block_hashes": [[rng.randbytes(32) for _ in range(rng.randint(4, 48))]]}
            else:
                fields = {}
            t0 = time.perf_counter_ns()
            try:
                reply = raw.call(op, **fields)
            except (OSError, RuntimeError, ValueError) as error:
                errors.append(f"{op}: {error}")
                break
            latencies[op].append(time.perf_counter_ns() - t0)
            answered += 1
            accepted += int(reply.get("accepted", 0))
            dropped += int(reply.get("dropped", 0))
    finally:
        raw.close()
    conn.send({"index": index, "answered": answered, "errors": errors,
               "latencies": latencies, "accepted": accepted, "dropped": dropped})


def books(before: dict[str, Any], after: dict[str, Any], accepted: int,
          dropped: int) -> dict[str, Any]:
    """The daemon's books over the run, against what the clients' acks said."""
    delta = {k: after["files"][k] - before["files"][k]
             for k in ("accepted", "dropped", *SETTLED)}
    settled = sum(delta[k] for k in SETTLED)
    return {
        "delta": delta,
        "in_flight_after_drain": after["files"]["in_flight"],
        "acks_accepted": accepted,
        "acks_dropped": dropped,
        "balance": delta["accepted"] == settled == accepted and delta["dropped"] == dropped
        and after["files"]["in_flight"] == 0,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a daemon (or use --socket), run the clients, drain, check the books."""
    args.base.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ds = datasets.dataset(f"{args.files}x{args.file_size}", args.seed, args.base)
    existing = datasets.ensure(ds, quiet=True)
    missing = [p.replace(".bin", ".pending.bin") for p in
               ack_latency.fake_paths(ds.root, 4 * len(existing), args.seed)]
    workdir = Path(tempfile.mkdtemp(prefix="kvload-"))
    daemon: Daemon | None = None
    total = args.clients * args.requests_per_client
    try:
        if args.socket:
            socket_path = args.socket
        else:
            # queues as deep as the default's: a burst may drop (and count) files
            daemon = start_daemon(args.engine, ds.root, 64 << 10, 0, args.workers,
                                  workdir, args.out)
            socket_path = daemon.socket
        with kvproto.RawClient(socket_path, timeout=30) as raw:
            before = raw.call("stats")["stats"]
        context = multiprocessing.get_context("fork")
        start_at = time.time() + 0.5
        pipes, procs = [], []
        for index in range(args.clients):
            receive, send = context.Pipe(duplex=False)
            proc = context.Process(target=client, args=(
                index, socket_path, args.requests_per_client, existing, missing, str(ds.root),
                args.seed, start_at, send))
            proc.start()
            send.close()
            pipes.append(receive)
            procs.append(proc)
        reports = []
        for receive, proc in zip(pipes, procs, strict=True):
            try:
                reports.append(receive.recv())
            except EOFError:
                reports.append({"index": len(reports), "answered": 0, "accepted": 0,
                                "dropped": 0, "latencies": {},
                                "errors": [f"client died (exit {proc.exitcode})"]})
            proc.join()
        seconds = time.time() - start_at
        drain_s = drain(socket_path)
        with kvproto.RawClient(socket_path, timeout=30) as raw:
            after = raw.call("stats")["stats"]
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    every = [ns for r in reports for values in r["latencies"].values() for ns in values]
    per_op = {}
    for op, _ in MIX:
        samples = [ns for r in reports for ns in r["latencies"].get(op, [])]
        if samples:
            per_op[op] = {k: v for k, v in ack_latency.summarize(samples).items()
                          if k != "cdf_us"}
    answered = sum(r["answered"] for r in reports)
    accepted = sum(r["accepted"] for r in reports)
    dropped = sum(r["dropped"] for r in reports)
    checked = books(before, after, accepted, dropped)
    return {
        "benchmark": "router_load",
        "what": "several client processes at once, each closed loop on its own connection: "
                "a seeded mix of small fire-and-forget prefetch (1-64 paths), "
                "prefetch_blocks (4-48 block hashes) and ping",
        "argv": sys.argv,
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(),
                    "loadavg_at_start": os.getloadavg()},
        "settings": {"clients": args.clients, "requests_per_client": args.requests_per_client,
                     "engine": args.engine, "workers": args.workers,
                     "mix": dict(MIX), "dataset": ds.name, "seed": args.seed,
                     "daemon": "started" if daemon is not None else args.socket},
        "seconds": round(seconds, 3),
        "drain_s": round(drain_s, 3),
        "requests": total,
        "answered": answered,
        "lost": total - answered,
        "errors": [e for r in reports for e in r["errors"]],
        "requests_per_s": answered / seconds if seconds > 0 else 0.0,
        "latency": ack_latency.summarize(every) if every else
        {"n": 0, "p50_us": 0.0, "p99_us": 0.0, "p999_us": 0.0, "max_us": 0.0, "cdf_us": []},
        "per_op": per_op,
        "files": {"accepted": accepted, "dropped": dropped},
        "books": checked,
        "books_balance": checked["balance"],
    }


def drain(socket_path: str, limit: float = 120.0) -> float:
    """Wait until every accepted file is settled; the seconds it took."""
    started = time.monotonic()
    with kvproto.RawClient(socket_path, timeout=30) as raw:
        while raw.call("stats")["stats"]["files"]["in_flight"] > 0:
            if time.monotonic() - started > limit:
                raise RuntimeError(f"the daemon did not drain its queues in {limit:.0f} s")
            time.sleep(0.02)
    return time.monotonic() - started


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=10_000)
    parser.add_argument("--socket", default="",
                        help="an already running daemon (its roots must hold --base)")
    parser.add_argument("--engine", default="pread")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--files", type=int, default=512, help="existing files in the set")
    parser.add_argument("--file-size", default="64KiB")
    parser.add_argument("--base", type=Path, default=datasets.DEFAULT_BASE)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quiet", action="store_true", help="no table at the end")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    if not args.quiet:
        lat = out["latency"]
        print(f"{out['requests']} requests from {args.clients} clients in {out['seconds']:.1f} s "
              f"({out['requests_per_s']:.0f}/s): answered {out['answered']}, lost {out['lost']}, "
              f"errors {len(out['errors'])}; ack p50 {lat['p50_us']:.0f} µs, "
              f"p99 {lat['p99_us']:.0f} µs, p999 {lat['p999_us']:.0f} µs; "
              f"books balance: {out['books_balance']}")
        for op, figures in out["per_op"].items():
            print(f"  {op:16s} n={figures['n']:6d}  p50 {figures['p50_us']:7.0f} µs  "
                  f"p99 {figures['p99_us']:7.0f} µs")
    return 0 if out["lost"] == 0 and not out["errors"] and out["books_balance"] else 1


if __name__ == "__main__":
    sys.exit(main())
