"""Warm-ups on real FUSE tiers (s3fs-fuse, rclone) and what reaches the consumer (issue 24).

For each tier configuration (kvharness.realtier: s3fs defaults / kernel_cache / use_cache,
rclone vfs_off / vfs_full, all over one local S3 endpoint behind a loopback delay proxy),
every repetition runs the methods in a fresh shuffled order, and before each the tier is
made cold (`Mount.cold()`: unmount, its disk cache cleared, drop_caches, settle, remount).
Per run: the warm-up's wall time, then a single-threaded consumer's time to read what the
engine reads of every file (the table's `extent`: its 1 MiB head, or the whole file), and
the endpoint requests (GET/HEAD/LIST) each of them sent: a consumer that still sends GETs
after a warm-up did not find it.

Methods:
- kvprefetchd: the daemon at its defaults, rooted at the mount, started after the mount
  and before the clock, running until the consumer has read (it runs beside a router; what
  it holds open for the consumer is part of its warm-up), asked as a router asks: one
  `prefetch` with `wait` through the Python client, timed to its reply; how much of each
  file it reads is its root's tier profile's (docs/tiers.md), not the table's `extent`.
- pool-N: N threads that open + read the extent + close each file (warmup_tools.warm_pool).
- vmtouch: `vmtouch -t` of whole files, what an operator would run.
- none: nothing: the consumer's cold time.

    .venv/bin/python bench/realtier.py --files 200 --size 4MiB --delay-ms 10 --reps 2 \\
        --tiers s3fs/defaults,s3fs/kernel_cache:head --out bench/out/realtier

Needs root, FUSE, s3fs, rclone and s3rver (./dev setup installs them):
kvharness.realtier.RealTierUnavailable says what is missing.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
from warmup_tools import pool_threads, warm_pool, warm_vmtouch

from kvharness import realtier
from kvharness.daemon import Daemon, start_config
from kvprefetch import Client

DAEMON = "kvprefetchd"
METHODS = (DAEMON, "pool-16", "pool-256", "vmtouch", "none")
EXTENTS = ("head", "whole")
HEAD = 1 << 20  # what the engine reads of a file: the connector's 1 MiB head
CONSUMER_TARGET = 1.1  # issue 24 "Done means": consumer time after the daemon / the best
WARMUP_TARGET = 1.15  # and its warm-up time / the best
OnRun = Callable[[str, str, int], None]
TABLE_KEYS = {"name", "files", "size", "delay_ms", "reps", "methods", "tiers", "settle",
              "seed"}


def parse_tiers(text: str) -> list[tuple[str, str, str]]:
    """'s3fs/defaults:head,rclone/vfs_full:whole' -> [(kind, config, extent)]; the extent
    defaults to head."""
    tiers = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, extent = item.partition(":")
        kind, _, config = name.partition("/")
        tiers.append((kind, config, extent or "head"))
    return tiers


def check(args: argparse.Namespace) -> list[str]:
    errors = []
    for kind, config, extent in parse_tiers(args.tiers):
        if config not in realtier.CONFIGS.get(kind, ()):
            errors.append(f"no tier {kind}/{config}: {realtier.CONFIGS}")
        if extent not in EXTENTS:
            errors.append(f"{kind}/{config}: extent {extent!r}, not one of {EXTENTS}")
    for method in args.methods.split(","):
        if method not in (DAEMON, "vmtouch", "none") and pool_threads(
                method.replace("pool-", "pypool-")) is None:
            errors.append(f"no method {method!r}: {DAEMON}, pool-N, vmtouch or none")
    if args.reps < 1 or args.files < 1:
        errors.append("reps and files: at least 1")
    return errors


def table_argv(entry: dict[str, Any], reps: int, out: Path) -> list[str]:
    """The command line of one [[realtier]] table of a scenario file (bench/suite.py)."""
    argv = ["--out", str(out), "--quiet", "--reps", str(entry.get("reps", reps))]
    for key in ("files", "size", "delay_ms", "settle", "seed"):
        if key in entry:
            argv += ["--" + key.replace("_", "-"), str(entry[key])]
    if "methods" in entry:
        argv += ["--methods", ",".join(entry["methods"])]
    if "tiers" in entry:
        argv += ["--tiers", ",".join(f"{t['kind']}/{t['config']}:{t.get('extent', 'head')}"
                                     for t in entry["tiers"])]
    return argv


def check_table(entry: dict[str, Any], reps: int) -> list[str]:
    if extra := set(entry) - TABLE_KEYS:
        return [f"unknown keys {sorted(extra)}"]
    for tier in entry.get("tiers", []):
        if extra := set(tier) - {"kind", "config", "extent"}:
            return [f"a tier has unknown keys {sorted(extra)}"]
    return check(parse_args(table_argv(entry, reps, Path("."))))


def table_label(entry: dict[str, Any]) -> str:
    name = str(entry.get("name", f"{entry.get('files', 200)}x{entry.get('size', '4MiB')}"))
    return "realtier/" + name


# --- one run ---------------------------------------------------------------------------------


def consume(paths: Sequence[str], extent: int) -> float:
    """The consumer: one thread reads [0, extent) of every file in order; its seconds."""
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            left = extent
            while left > 0 and (chunk := handle.read(min(left, 1 << 20))):
                left -= len(chunk)
    return time.perf_counter() - started


def warm_daemon(daemon: Daemon, paths: Sequence[str]) -> dict[str, Any]:
    """One `prefetch` with `wait` of every path through the Python client, as a router
    sends it, on a daemon at its defaults: what it reads of each file is its root's tier
    profile's (warm_extent = "auto"). Timed from the request to the reply. (The CLI,
    `kvprefetch warm --wait -f LIST`, answers the same and adds ~0.2 s of Python start-up
    on this machine: not the router's path.)"""
    try:
        with Client(daemon.socket_path, timeout=None) as client:
            started = time.perf_counter()
            reply = client.prefetch(paths, wait=True, timeout_ms=600_000)
            wall = time.perf_counter() - started
        outcomes = reply.outcomes or {}
        # `futile` is an answer too: a tier whose near tier does not survive a reopen. A run
        # fails when a file got no answer or a bad one.
        answered = sum(outcomes.values()) == len(paths)
        bad = sum(outcomes.get(name, 0) for name in ("failed", "missing", "rejected",
                                                       "expired")) if answered else 1
        return {"seconds": wall, "ok": answered and not bad,
                "detail": {"outcomes": outcomes}}
    except BaseException:
        daemon.stop()
        raise


def run_one(method: str, fs: realtier.Mount, proxy: realtier.DelayProxy, paths: list[str],
            list_file: Path, extent: int, workdir: Path) -> dict[str, Any]:
    """cold -> warm-up -> consumer, with the endpoint requests each sent."""
    fs.cold()
    daemon: Daemon | None = None
    if method == DAEMON:  # started before the clock, as it runs before any request
        daemon = start_config(workdir / "daemon", {"roots": [str(fs.path)]},
                              log_path=workdir / "daemon" / "daemon.log")
    before = proxy.counts()
    if method == "none":
        result: dict[str, Any] = {"seconds": None, "ok": True, "detail": {}}
    elif daemon is not None:
        result = warm_daemon(daemon, paths)
    elif method == "vmtouch":
        result = warm_vmtouch(list_file, None)
    else:
        threads = pool_threads(method.replace("pool-", "pypool-"))
        assert threads is not None
        result = warm_pool(paths, extent, threads)
        result["detail"].pop("bytes", None)
    after_warm = proxy.counts()
    try:
        # The daemon runs on while the consumer reads, as it does beside a router: what
        # it holds open for the consumer (docs/tiers.md, `hold`) is part of its warm-up.
        consumer = consume(paths, extent)
    finally:
        if daemon is not None:
            daemon.stop()
    after = proxy.counts()
    return {"method": method, "warm_s": result["seconds"], "consumer_s": consumer,
            "ok": bool(result["ok"]), "detail": result["detail"],
            "warm_requests": realtier.requests_between(before, after_warm),
            "consumer_requests": realtier.requests_between(after_warm, after)}


# --- the run ---------------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per method; the best method's times (of the warmers, the daemon included);
    the daemon's ratios to them against the targets."""
    methods: dict[str, Any] = {}
    for method, rows in runs.items():
        methods[method] = {
            "warm_s": _median([r["warm_s"] for r in rows]),
            "consumer_s": _median([r["consumer_s"] for r in rows]),
            "consumer_gets": _median([r["consumer_requests"]["GET"] for r in rows]),
            "consumer_heads": _median([r["consumer_requests"]["HEAD"] for r in rows]),
            "warm_gets": _median([r["warm_requests"]["GET"] for r in rows]),
            "ok": all(r["ok"] for r in rows)}
    warmers = {m: v for m, v in methods.items() if m != "none"}
    best_consumer = min((v["consumer_s"] for v in warmers.values()), default=None)
    best_warm = min((v["warm_s"] for v in warmers.values() if v["warm_s"] is not None),
                    default=None)
    daemon = methods.get(DAEMON)
    ratios = None
    if daemon and best_consumer and best_warm:
        consumer_ratio = daemon["consumer_s"] / best_consumer
        warm_ratio = daemon["warm_s"] / best_warm
        ratios = {"consumer": round(consumer_ratio, 2), "warm": round(warm_ratio, 2),
                  "consumer_met": consumer_ratio <= CONSUMER_TARGET,
                  "warm_met": warm_ratio <= WARMUP_TARGET}
    return {"methods": methods, "best_consumer_s": best_consumer, "best_warm_s": best_warm,
            "daemon_ratios": ratios}


def run(args: argparse.Namespace, on_run: OnRun | None = None) -> dict[str, Any]:
    """Every tier, repetition and method; the results. Raises RealTierUnavailable."""
    if errors := check(args):
        raise SystemExit("; ".join(errors))
    tiers = parse_tiers(args.tiers)
    realtier.check_available(tuple(dict.fromkeys(kind for kind, _, _ in tiers)))
    size = datasets.parse_size(args.size)
    methods = [m for m in args.methods.split(",") if m]
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="kvrealtier-"))
    results: dict[str, Any] = {
        "kind": "realtier", "files": args.files, "size": size, "delay_ms": args.delay_ms,
        "reps": args.reps, "methods": methods, "settle_s": args.settle, "tiers": []}
    try:
        with realtier.endpoint(workdir / "endpoint", args.files, size,
                               args.delay_ms) as (server, proxy):
            results["endpoint"] = {"kind": server.kind, "processes": len(server.ports),
                                   "upload_s": round(time.time() - started, 1)}
            ceiling_proxy = realtier.DelayProxy(server.ports, 0, workdir / "endpoint")
            try:  # the endpoint itself (no delay): what no warmer can beat
                results["endpoint"]["ceiling"] = realtier.ceiling(
                    ceiling_proxy.port, server.dataset.keys, 16, args.ceiling_s)
            finally:
                ceiling_proxy.close()
            for index, (kind, config, extent_name) in enumerate(tiers):
                extent = size if extent_name == "whole" else min(HEAD, size)
                results["tiers"].append(run_tier(
                    args, index, kind, config, extent_name, extent, proxy, methods,
                    workdir / f"{kind}-{config}", on_run))
    finally:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    results["seconds"] = round(time.time() - started, 1)
    return results


def run_tier(args: argparse.Namespace, index: int, kind: str, config: str, extent_name: str,
             extent: int, proxy: realtier.DelayProxy, methods: list[str], workdir: Path,
             on_run: OnRun | None) -> dict[str, Any]:
    started = time.time()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    orders = []
    with realtier.mount(kind, config, proxy.url, workdir, files=args.files,
                        settle=args.settle) as fs:
        paths = fs.paths()
        list_file = workdir / "paths.txt"
        list_file.write_text("\n".join(paths) + "\n")
        for rep in range(args.reps):
            order = list(methods)
            random.Random((args.seed * 1000 + index) * 100 + rep).shuffle(order)
            orders.append(order)
            for position, method in enumerate(order):
                one = run_one(method, fs, proxy, paths, list_file, extent, workdir)
                runs[method].append({"rep": rep, "position": position, **one})
                if on_run is not None:
                    on_run(f"{kind}/{config}", method, rep)
        settings = fs.settings()
    return {"kind": kind, "config": config, "extent": extent_name, "extent_bytes": extent,
            "mount": settings, "orders": orders, "runs": runs,
            "seconds": round(time.time() - started, 1), **summarize(runs)}


# --- tables ----------------------------------------------------------------------------------

TABLE_HEAD = ["tier", "extent", "method", "warm-up s", "consumer s", "consumer GET/HEAD",
              "warm-up GETs", "daemon x best", "daemon said"]


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per tier and method: medians; the daemon's ratios (consumer, warm-up)."""
    out = []
    for tier in results["tiers"]:
        ratios = tier["daemon_ratios"]
        for method, m in tier["methods"].items():
            runs = tier["runs"][method]
            ratio, said = "", ""
            if method == DAEMON:
                said = "; ".join(_outcomes(r["detail"].get("outcomes")) for r in runs)
            if method == DAEMON and ratios:
                ratio = (f"{ratios['consumer']:.2f} / {ratios['warm']:.2f}"
                         f"{'' if ratios['consumer_met'] and ratios['warm_met'] else ' (!)'}")
            out.append([f"{tier['kind']}/{tier['config']}", tier["extent"], method,
                        ", ".join(_f(r["warm_s"]) for r in runs),
                        ", ".join(_f(r["consumer_s"]) for r in runs),
                        f"{_f(m['consumer_gets'], '.0f')}/{_f(m['consumer_heads'], '.0f')}",
                        _f(m["warm_gets"], ".0f"), ratio + ("" if m["ok"] else " (failed)"),
                        said])
    return out


def _outcomes(outcomes: Any) -> str:
    """The daemon's answer in short: 'read 118, futile 2'."""
    if not isinstance(outcomes, dict):
        return "?"
    return ", ".join(f"{name} {count}" for name, count in outcomes.items() if count) or "-"


def text_table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     for row in [head, *body])


def md_table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def title(results: dict[str, Any]) -> str:
    ceiling = results.get("endpoint", {}).get("ceiling", {})
    fuse = {t["mount"]["fuse"].get("max_background") for t in results["tiers"]}
    return (f"{results['files']} x {datasets.format_size(results['size'])} objects, "
            f"+{2 * results['delay_ms']:g} ms RTT, {results['reps']} reps (each run listed), "
            f"FUSE max_background {sorted(v for v in fuse if v is not None)}; endpoint "
            f"ceiling {ceiling.get('get_per_s', '-')} GET/s, {ceiling.get('head_per_s', '-')}"
            f" HEAD/s at 16 clients. `daemon x best`: consumer / warm-up time after the "
            f"daemon over the best method's (targets {CONSUMER_TARGET} / {WARMUP_TARGET})")


def markdown(results: dict[str, Any]) -> str:
    return f"**Real tiers**: {title(results)}\n\n" + md_table(TABLE_HEAD, rows(results))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--size", default="4MiB")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one way, each way")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tiers", default=",".join(
        f"{kind}/{config}:head" for kind, configs in realtier.CONFIGS.items()
        for config in configs), help="comma list of KIND/CONFIG[:head|whole]")
    parser.add_argument("--settle", type=float, default=realtier.SETTLE_S)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ceiling-s", type=float, default=3.0,
                        help="seconds per request kind of the endpoint's ceiling")
    parser.add_argument("--out", type=Path, default=Path("bench/out/realtier"))
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: unmount, stop
    try:
        results = run(args, None if args.quiet else lambda tier, method, rep: print(
            f"{time.strftime('%H:%M:%S')} {tier} {method} #{rep + 1}", file=sys.stderr,
            flush=True))
    except realtier.RealTierUnavailable as error:
        print(f"realtier: {error}", file=sys.stderr)
        return 1 if realtier.required() else 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(title(results) + "\n")
    print(text_table(TABLE_HEAD, rows(results)))
    print(f"\nresults: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
