"""Many clients at once: does every request get its answer, and how fast are the acks?

A router fleet calls the daemon from many processes, each with its own connection,
mostly with small fire-and-forget `prefetch` requests (1-64 files of a KV tree), now
and then a `prefetch_blocks` (token ids the daemon hashes into paths itself) or a
`ping`. This drives that mix from separate client processes (the daemon's single
supervisor thread must not be helped by a client sharing its GIL), records every
request's ack latency (send to reply, so it includes any wait behind the other
clients: that is what a caller sees), and counts what was answered, lost and refused.

    .venv/bin/python bench/loadgen.py --out bench/out/load                 # own daemon
    .venv/bin/python bench/loadgen.py --socket /run/kvprefetchd/kvprefetchd.sock --out DIR

    from loadgen import run_load
    result = run_load(sock, clients=8, requests_per_client=10_000)

This is the reusable half (run_load, LoadRun) that tests/integration/test_load.py,
bench/soak.py and bench/load.py (the benchmark suite's router-like load scenario) build on.

`lost` is requests sent without a reply before the client gave up (idle_timeout
without any reply): it must be 0. Latency figures are per request in ms: p50, p99,
p999, max, overall and per op. bench/soak.py runs the same clients for 10^6
requests while sampling the daemon's memory and fds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import socket
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from percentiles import cdf, nearest_rank

from kvharness.daemon import Daemon, start_config
from kvharness.wire import FrameSplitter, RawConnection, pack, unpack

DEFAULT_MIX = {"prefetch": 0.90, "prefetch_blocks": 0.05, "ping": 0.05}
BLOCK_SIZE = 16  # tokens per vLLM block in the inline profile prefetch_blocks uses


@dataclass(frozen=True)
class ClientPlan:
    """What one client process sends; picklable, so it crosses into a spawned process."""

    socket_path: str
    index: int
    requests: int
    paths: tuple[str, ...]  # the KV tree to draw from
    paths_per_request: tuple[int, int]
    mix: tuple[tuple[str, float], ...]
    pipeline: int  # requests in flight per connection (1: closed loop)
    seed: int
    blocks_layout: dict[str, Any] | None  # inline layout for prefetch_blocks (None: none)
    idle_timeout: float


@dataclass
class ClientResult:
    index: int
    sent: int = 0
    answered: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # error code -> count
    ops: dict[str, int] = field(default_factory=dict)  # op -> answered ok
    files: dict[str, int] = field(default_factory=dict)  # accepted/dropped/rejected sums
    failure: str = ""  # why the client stopped early, if it did
    seconds: float = 0.0
    latency_ms: dict[str, array[float]] = field(default_factory=dict)  # op -> per request


def blocks_layout(dataset: datasets.Dataset) -> dict[str, Any]:
    """An inline profile whose files land in the dataset's model folder (as missing files:
    token ids hash to blocks nobody wrote, which is what most routed prompts look like)."""
    folder = dataset.model_dir.name  # <safe_model>_<fp12>_r0
    fingerprint = folder.rsplit("_", 2)[-2]
    return {"hash": {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": BLOCK_SIZE,
                     "vllm_version": "0.23.0"},
            "layout": {"root_dir": str(dataset.root), "model_name": datasets.MODEL,
                       "tp_size": 1, "kv_cache_groups": [{"block_size": BLOCK_SIZE}],
                       "connector_block_size_tokens": 256, "fingerprint": fingerprint}}


def _request(plan: ClientPlan, rng: random.Random, ops: Sequence[str],
             weights: Sequence[float], request_id: int) -> tuple[str, bytes]:
    op = rng.choices(ops, weights)[0]
    body: dict[str, Any] = {"v": 1, "id": request_id, "op": op}
    if op == "prefetch":
        count = rng.randint(*plan.paths_per_request)
        start = rng.randrange(len(plan.paths))  # a contiguous run: one prompt's blocks
        body["paths"] = [plan.paths[(start + i) % len(plan.paths)] for i in range(count)]
    elif op == "prefetch_blocks":
        assert plan.blocks_layout is not None
        tokens = rng.randint(4, 64) * BLOCK_SIZE
        first = rng.randrange(1 << 20)
        body.update(plan.blocks_layout)
        body["prompts"] = [{"token_ids": list(range(first, first + tokens))}]
    return op, pack(body)


def run_client(plan: ClientPlan) -> ClientResult:
    """One connection, `plan.requests` requests, up to `plan.pipeline` in flight."""
    result = ClientResult(plan.index)
    rng = random.Random(plan.seed * 1_000_003 + plan.index)
    ops = [op for op, _ in plan.mix]
    weights = [w for _, w in plan.mix]
    latencies: dict[str, array[float]] = {op: array("d") for op in ops}
    errors: Counter[str] = Counter()
    answered_ops: Counter[str] = Counter()
    files: Counter[str] = Counter()
    in_flight: dict[int, tuple[str, float]] = {}
    frames = FrameSplitter()
    started = time.perf_counter()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(plan.idle_timeout)
    try:
        sock.connect(plan.socket_path)
        next_id = 1
        while result.sent < plan.requests or in_flight:
            while len(in_flight) < plan.pipeline and result.sent < plan.requests:
                op, frame = _request(plan, rng, ops, weights, next_id)
                in_flight[next_id] = (op, time.perf_counter())
                sock.sendall(frame)
                result.sent += 1
                next_id += 1
            data = sock.recv(1 << 20)  # socket.timeout after idle_timeout without a reply
            if not data:
                raise ConnectionError("the daemon closed the connection")
            now = time.perf_counter()
            for body in frames.bodies(data):
                reply = unpack(body)
                sent_op, sent_at = in_flight.pop(reply.get("id"), ("?", now))
                result.answered += 1
                latencies.setdefault(sent_op, array("d")).append((now - sent_at) * 1e3)
                if reply.get("ok") is True:
                    answered_ops[sent_op] += 1
                    for key in ("accepted", "dropped", "rejected"):
                        files[key] += int(reply.get(key, 0))
                else:
                    errors[str((reply.get("error") or {}).get("code", "?"))] += 1
    except (OSError, ValueError) as error:
        result.failure = f"{type(error).__name__}: {error}"
    finally:
        sock.close()
    result.seconds = time.perf_counter() - started
    result.errors, result.ops, result.files = dict(errors), dict(answered_ops), dict(files)
    result.latency_ms = latencies
    return result


def latency_summary(values: Sequence[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"count": len(ordered), "p50": nearest_rank(ordered, 50),
            "p99": nearest_rank(ordered, 99), "p999": nearest_rank(ordered, 99.9),
            "max": ordered[-1] if ordered else None,
            "mean": sum(ordered) / len(ordered) if ordered else None, "cdf": cdf(ordered)}


class LoadRun:
    """Client processes started now, gathered by `wait` (bench/soak.py samples between)."""

    def __init__(self, plans: Sequence[ClientPlan]) -> None:
        self.plans = list(plans)
        # spawn, not fork: the caller (pytest, a sampler) may have threads, and each
        # client must be its own interpreter with its own GIL anyway.
        self.pool = multiprocessing.get_context("spawn").Pool(len(self.plans))
        self.started = time.perf_counter()
        self.pending = self.pool.map_async(run_client, self.plans)

    def ready(self) -> bool:
        return self.pending.ready()

    def wait(self, poll: Callable[[], None] | None = None, interval: float = 1.0
             ) -> list[ClientResult]:
        """Every client's result; `poll` is called every `interval` s meanwhile (once at least)."""
        try:
            while True:
                self.pending.wait(interval)
                if poll is not None:
                    poll()
                if self.pending.ready():
                    break
            results: list[ClientResult] = self.pending.get()
        finally:
            self.pool.close()
            self.pool.join()
        self.seconds = time.perf_counter() - self.started
        return results


def plans_for(socket_path: str, paths: Sequence[str], *, clients: int, requests_per_client: int,
              paths_per_request: tuple[int, int], mix: Mapping[str, float], pipeline: int,
              seed: int, layout: dict[str, Any] | None, idle_timeout: float
              ) -> list[ClientPlan]:
    if mix.get("prefetch_blocks") and layout is None:
        raise ValueError("prefetch_blocks in the mix needs a layout (blocks_layout(dataset))")
    if not paths and mix.get("prefetch"):
        raise ValueError("prefetch in the mix needs paths to draw from")
    return [ClientPlan(socket_path, index, requests_per_client, tuple(paths), paths_per_request,
                       tuple((op, float(w)) for op, w in mix.items() if w > 0), pipeline, seed,
                       layout, idle_timeout) for index in range(clients)]


def summarize(results: Sequence[ClientResult], seconds: float) -> dict[str, Any]:
    """The figures of a run: answered/lost/errors, files, ack latency overall and per op."""
    sent = sum(r.sent for r in results)
    answered = sum(r.answered for r in results)
    by_op: dict[str, list[float]] = {}
    for r in results:
        for op, values in r.latency_ms.items():
            by_op.setdefault(op, []).extend(values)
    every = [v for values in by_op.values() for v in values]

    def total(attr: str) -> dict[str, int]:
        return dict(sum((Counter(getattr(r, attr)) for r in results), Counter()))

    return {
        "clients": len(results), "sent": sent, "answered": answered, "lost": sent - answered,
        "errors": total("errors"), "ok_by_op": total("ops"),
        "files": {key: total("files").get(key, 0) for key in ("accepted", "dropped", "rejected")},
        "client_failures": [r.failure for r in results if r.failure],
        "seconds": round(seconds, 3), "requests_per_s": round(answered / seconds, 1)
        if seconds else None,
        "ack_ms": latency_summary(every),
        "ack_ms_by_op": {op: latency_summary(values) for op, values in sorted(by_op.items())},
    }


def run_load(socket_path: str, clients: int = 8, requests_per_client: int = 10_000,
             paths_per_request: tuple[int, int] = (1, 64),
             mix: Mapping[str, float] | None = None, *, paths: Sequence[str] = (),
             layout: dict[str, Any] | None = None, pipeline: int = 1, seed: int = 1,
             idle_timeout: float = 60.0) -> dict[str, Any]:
    """Run the clients against a daemon on socket_path and return summarize()'s figures.

    `paths`: the KV tree the prefetches draw from (a run of consecutive ones per request,
    as one prompt's blocks are); `layout`: the inline hash/layout maps prefetch_blocks
    sends (blocks_layout(dataset)); `pipeline`: requests in flight per client.
    """
    plans = plans_for(socket_path, paths, clients=clients,
                      requests_per_client=requests_per_client,
                      paths_per_request=paths_per_request, mix=mix or DEFAULT_MIX,
                      pipeline=pipeline, seed=seed, layout=layout, idle_timeout=idle_timeout)
    run = LoadRun(plans)
    results = run.wait()
    return summarize(results, run.seconds)


# ---- a daemon of our own (when no --socket is given) --------------------------------------


def own_daemon(root: Path, workdir: Path, workers: int = 2) -> Daemon:
    """kvprefetchd on root (engine auto), logging at warning, its socket in workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    return start_config(workdir, {"roots": [str(root)], "workers": workers, "engine": "auto"},
                        log_path=workdir / "daemon.log", new_session=True)


def settle(socket_path: str, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until the workers have settled every accepted file; the stats then."""
    deadline = time.monotonic() + timeout
    while True:
        with RawConnection(socket_path) as connection:
            stats: dict[str, Any] = connection.call_ok("stats")["stats"]
        if stats["files"]["in_flight"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def books_balance(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Every accepted file has exactly one outcome once nothing is in flight (books.py)."""
    files = stats["files"]
    settled = sum(files[k] for k in ("read", "resident", "missing", "rejected", "failed"))
    return {"accepted": files["accepted"], "settled": settled, "in_flight": files["in_flight"],
            "balanced": files["accepted"] == settled + files["in_flight"]
            and files["in_flight"] == 0}


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        op, _, weight = part.partition("=")
        mix[op.strip()] = float(weight)
    return mix


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", help="an existing daemon (default: start one on --dataset)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10_000, help="per client")
    parser.add_argument("--paths", default="1-64", help="paths per prefetch: LO-HI")
    parser.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()))
    parser.add_argument("--pipeline", type=int, default=1, help="requests in flight per client")
    parser.add_argument("--dataset", default="2000x64KiB", help="COUNTxSIZE (bench/datasets.py)")
    parser.add_argument("--base", type=Path, default=datasets.DEFAULT_BASE)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    lo, _, hi = args.paths.partition("-")
    ds = datasets.dataset(args.dataset, base=args.base)
    paths = datasets.ensure(ds)
    daemon: Daemon | None = None
    workdir = Path(tempfile.mkdtemp(prefix="kvload-"))
    socket_path = args.socket
    if socket_path is None:
        daemon = own_daemon(ds.root, workdir, args.workers)
        socket_path = daemon.socket_path
    try:
        result = run_load(socket_path, args.clients, args.requests, (int(lo), int(hi or lo)),
                          parse_mix(args.mix), paths=paths, layout=blocks_layout(ds),
                          pipeline=args.pipeline, seed=args.seed)
        stats = settle(socket_path)
        result["books"] = books_balance(stats)
        result["daemon_ack_seconds"] = stats["latency"]["ack_seconds"]
    finally:
        if daemon is not None:
            daemon.stop()
    result["setup"] = {"dataset": ds.name, "root": str(ds.root), "socket": socket_path,
                       "own_daemon": daemon is not None, "workers": args.workers,
                       "pipeline": args.pipeline, "paths_per_request": args.paths,
                       "mix": args.mix, "host": platform.node(), "cpus": os.cpu_count(),
                       "kernel": platform.release(),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(result, indent=1) + "\n")
    ack = result["ack_ms"]
    print(f"{result['answered']}/{result['sent']} answered, lost {result['lost']}, errors "
          f"{result['errors']}, {result['requests_per_s']} req/s; ack ms p50 {ack['p50']:.3f} "
          f"p99 {ack['p99']:.3f} p999 {ack['p999']:.3f}; books balanced "
          f"{result['books']['balanced']} -> {args.out / 'load.json'}")
    return 0 if result["lost"] == 0 and not result["client_failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
