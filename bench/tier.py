"""Warm-up time on a slow storage tier: kvprefetchd's engines against thread pools, fio, vmtouch.

The local disk hides what kvprefetchd is for: on a tiered file system the first read of a
cold file waits for a remote fetch, and warm-up time is about files x latency / reads in
flight (issue 13). Here the tier is bench/tiersim, the FUSE simulator, mounted over a
dataset once; the methods (tier_methods.py) read the SAME files through the SAME mount, at
each point of a latency sweep (the simulator's latency changed between points, its other
settings fixed: jitter, chunk, fetch slots, bandwidth). Before every method the tier is
made cold (`evict-all`) and its counters reset; every repetition runs the methods in a
fresh shuffled order. Per run: wall time, the simulator's counters (fetches, peak in
flight), whether every head was fetched (st_blocks), the heads' page-cache residency on
a sample, CPU (tier_measure.py). Figures and targets: tier_summary.py.

    .venv/bin/python bench/tier.py --dataset 200x512KiB --head 256KiB --latency-ms 20 \\
        --out bench/out/tier

Points run in increasing latency. With --run-budget-s, a method whose median run at a
point took longer than that is not run at the sweep's later (slower) points, and says so:
vmtouch fetches one chunk at a time, so at 100 ms it would take files x 0.1 s.

Needs root and FUSE (tiersim.FuseUnavailable says why not).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cold
import datasets
import machine
import tier_methods
import tier_summary
from tier_measure import measure
from warmup_daemon import make_prefetcher
from warmup_methods import Env
from warmup_tools import build_uring_heads

import tiersim

OnRun = Callable[[float, str, int], None]
# What a [[tier]] table of a scenario file sets (bench/suite.py), as this script's options:
# the TOML key is the option without "--", "_" for "-"; a TOML list is a comma list.
TABLE_OPTIONS: dict[str, tuple[type, Any, str]] = {
    "dataset": (str, "200x512KiB", "COUNTxSIZE: files of one size"),
    "head": (str, "256KiB", "bytes to warm per file"),
    "latency_ms": (str, "20", "comma list: the sweep's points, in ms"),
    "jitter_ms": (float, 0.0, "plus uniform(0, jitter) ms per fetch"),
    "chunk": (str, "1MiB", "the tier's fetch unit"),
    "slots": (int, 0, "fetches in flight at most (0: no cap)"),
    "bandwidth": (int, 0, "bytes/s over all fetches (0: no cap)"),
    "methods": (str, ",".join(tier_methods.METHODS), "comma list (tier_methods.py)"),
    "reps": (int, 3, "repetitions of every point"),
    "workers": (int, 2, "daemon workers"),
    "fio_depth": (int, 1024, "fio's (and uring_heads') depth: not what limits them"),
    "run_budget_s": (float, 0.0, "a method whose median run took longer leaves the later "
                     "points (0: never)"),
}
TABLE_KEYS = {"name", *TABLE_OPTIONS}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, (kind, default, text) in TABLE_OPTIONS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=kind, default=default,
                            help=f"{text} (default %(default)s)")
    parser.add_argument("--seed", type=int, default=datasets.DEFAULT_SEED)
    parser.add_argument("--base", type=Path, default=datasets.DEFAULT_BASE,
                        help="where datasets live (default %(default)s)")
    parser.add_argument("--chunk-paths", type=int, default=1000,
                        help="paths per pipelined request to the daemon")
    parser.add_argument("--residency-sample", type=int, default=200,
                        help="files whose heads' page-cache residency is read after a run")
    parser.add_argument("--order-seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def check(args: argparse.Namespace) -> list[str]:
    """What is wrong with these settings (empty: nothing), before anything runs."""
    errors = []
    try:
        ds = datasets.dataset(args.dataset)
        if ds.mixed:
            errors.append(f"{args.dataset}: a tier needs files of one size (COUNTxSIZE)")
        elif datasets.parse_size(args.head) > ds.size:
            errors.append(f"head {args.head} is larger than the files ({ds.size} bytes)")
        datasets.parse_size(args.chunk)
        latencies(args)
    except ValueError as error:
        errors.append(str(error))
    errors += [why for m in method_list(args) if (why := tier_methods.unknown(m))]
    return errors


def table_argv(entry: dict[str, Any], reps: int, base: Path, out: Path) -> list[str]:
    """The command line of one [[tier]] table; `reps` unless it says otherwise."""
    argv = ["--base", str(base), "--out", str(out), "--quiet", "--reps", str(reps)]
    for key, value in entry.items():
        if key in TABLE_OPTIONS:
            text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
            argv += ["--" + key.replace("_", "-"), text]
    return argv


def check_table(entry: dict[str, Any], reps: int) -> list[str]:
    """What is wrong with a [[tier]] table, by key (empty: nothing)."""
    if extra := set(entry) - TABLE_KEYS:
        return [f"unknown keys {sorted(extra)}"]
    if "dataset" not in entry:
        return ["needs a dataset"]
    return check(parse_args(table_argv(entry, reps, Path("."), Path("."))))


def table_label(entry: dict[str, Any]) -> str:
    """tier/<name>, or tier/<dataset>/unlimited (or /<n>-slots)."""
    slots = entry.get("slots", 0)
    return "tier/" + entry.get("name", f"{datasets.dataset(entry['dataset']).name}/"
                               + (f"{slots}-slots" if slots else "unlimited"))


def latencies(args: argparse.Namespace) -> list[float]:
    return sorted(float(v) for v in str(args.latency_ms).split(",") if v.strip())


def method_list(args: argparse.Namespace) -> list[str]:
    return [m for m in args.methods.split(",") if m]


def run(args: argparse.Namespace, on_run: OnRun | None = None) -> dict[str, Any]:
    """Every point, repetition and method (module docstring); the results.

    Raises tiersim.FuseUnavailable where the simulator cannot mount."""
    if errors := check(args):
        raise SystemExit("; ".join(errors))
    tiersim.check_fuse()
    ds = datasets.dataset(args.dataset, args.seed, args.base)
    backing = datasets.ensure(ds, quiet=args.quiet)
    head, chunk = datasets.parse_size(args.head), datasets.parse_size(args.chunk)
    methods = method_list(args)
    skipped = tier_methods.skipped(methods)
    active = [m for m in methods if m not in skipped]

    def tell(latency: float, method: str, rep: int, one: dict[str, Any]) -> None:
        if not args.quiet:
            print(f"{latency:g} ms rep {rep} {method:28s} "
                  f"{tier_summary.fmt(one['wall_s'], '.3f')} s, {one['tier']['fetches']} "
                  f"fetches, peak {one['tier']['peak_in_flight']}"
                  f"{'' if one['ok'] else '  (!)'}", file=sys.stderr)
        if on_run is not None:
            on_run(latency, method, rep)

    workdir = Path(tempfile.mkdtemp(prefix="kvbench-tier-"))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    options = {"jitter_ms": args.jitter_ms, "chunk_bytes": chunk, "slots": args.slots,
               "bandwidth": args.bandwidth}
    points: list[dict[str, Any]] = []
    orders: list[list[str]] = []
    daemons: dict[str, Any] = {}
    try:
        with tiersim.mount(ds.root, workdir / "mnt", latency_ms=latencies(args)[0],
                           **options) as tier:
            paths = [str(tier.mountpoint / os.path.relpath(p, ds.root)) for p in backing]
            uring = build_uring_heads(workdir) if "uring_heads" in active else None
            daemons = tier_methods.start_daemons(active, tier.mountpoint, head, len(paths),
                                                 args.workers, workdir, args.out)
            try:  # the daemons stop before the tier unmounts
                env = tier_methods.environment(
                    paths, head, workdir, tier.mountpoint / os.path.relpath(ds.model_dir,
                                                                            ds.root),
                    args.fio_depth, daemons, make_prefetcher("auto")[1], args.chunk_paths,
                    uring)
                sweep = Sweep(args, env, tier, backing, ds.size,
                              cold.sample(paths, args.residency_sample, args.seed), orders,
                              tell)
                for latency in latencies(args):
                    tier.set(latency_ms=latency)
                    point = point_settings(args, latency, len(paths), -(-head // chunk),
                                           tier.options.max_background)
                    runs = sweep.point(latency, len(points), active)
                    points.append(tier_summary.summarize_point(point, runs, len(paths), head,
                                                               skipped))
                    active = over_budget(points[-1], active, skipped, args.run_budget_s)
            finally:
                for daemon in daemons.values():
                    daemon.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        **machine.run_header("tier", started),
        "machine": {**machine.description(), "euid": os.geteuid()},
        "dataset": {"name": ds.name, "root": str(ds.root), "files": len(backing),
                    "file_bytes": ds.size, "seed": ds.seed},
        "head_bytes": head,
        "tier": {**options, "latencies_ms": latencies(args),
                 "max_background": tiersim.TierOptions().max_background},
        "reps": args.reps, "workers": args.workers, "fio_depth": args.fio_depth,
        "chunk_paths": args.chunk_paths, "run_budget_s": args.run_budget_s,
        "daemons": tier_methods.daemon_settings(daemons),
        "orders": orders,
        "ratios": "paired: the median over repetitions of method/reference in the same "
                  "repetition; below 1 is faster than the reference",
        "simulator_ceiling": tier_summary.CEILING,
        "points": points,
        "targets": tier_summary.targets(points),
    }


@dataclass
class Sweep:
    """What every run of one [[tier]] table shares: the mount, its files, the methods' Env."""

    args: argparse.Namespace
    env: Env
    tier: tiersim.Tier
    backing: list[str]
    file_bytes: int
    sample: list[str]
    orders: list[list[str]]
    tell: Callable[[float, str, int, dict[str, Any]], None]

    def point(self, latency: float, index: int, active: list[str]) -> dict[str, list[Any]]:
        """Every repetition of every active method at the tier's current setting."""
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in active}
        for rep in range(self.args.reps):
            order = list(active)
            random.Random((self.args.order_seed * 1000 + index) * 100 + rep).shuffle(order)
            self.orders.append(order)
            for position, method in enumerate(order):
                one = measure(self.env, self.tier, method, self.backing, self.file_bytes,
                              tier_methods.reads_whole_files(method), self.sample)
                runs[method].append({"rep": rep, "position": position, **one})
                self.tell(latency, method, rep, one)
        return runs


def point_settings(args: argparse.Namespace, latency: float, files: int, per_file: int,
                   max_background: int) -> dict[str, Any]:
    """A point's tier setting and the references that follow from it alone."""
    return {"latency_ms": latency, "slots": args.slots, "jitter_ms": args.jitter_ms,
            "loadavg": os.getloadavg(),
            "ideal_s": tier_summary.ideal_s(files, per_file, latency, args.jitter_ms,
                                            args.slots),
            "simulator_floor_s": tier_summary.simulator_floor_s(
                files, per_file, latency, args.jitter_ms,
                min(args.slots or max_background, max_background))}


def over_budget(point: dict[str, Any], active: list[str], skipped: dict[str, str],
                budget: float) -> list[str]:
    """The methods still to run at slower points; the others are skipped from now on."""
    if not budget:
        return active
    keep = []
    for method in active:
        wall = point["methods"][method].get("wall_s")
        if wall is not None and wall > budget:
            skipped[method] = (f"its median run at {point['latency_ms']:g} ms took "
                               f"{wall:.0f} s, over the run budget of {budget:g} s")
        else:
            keep.append(method)
    return keep


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: daemons stop, unmount
    try:
        results = run(args)
    except tiersim.FuseUnavailable as error:
        print(f"tier: {error}", file=sys.stderr)
        return 1 if tiersim.fuse_required() else 0
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{results['dataset']['name']}, head {datasets.format_size(results['head_bytes'])}"
          f", {args.reps} reps; median s (x best pool, or x ideal with slots) peak in flight:")
    print(tier_summary.text_table(*tier_summary.sweep_rows(results["points"])))
    if results["targets"]:
        print("\n" + tier_summary.text_table(tier_summary.TARGET_HEAD,
                                             tier_summary.target_rows(results["targets"])))
    print(f"\nresults: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
