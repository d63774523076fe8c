"""The router replay (issue 25 item 1): is each request's set warm when its consumer reads it?

A stream of requests (replay_stream.py: Poisson arrivals, Zipf-popular documents behind
shared system prompts, some files warm already) is replayed against a slow tier, bench/tiersim
mounted as bench/tier.py mounts it, with a finite number of fetch slots: its capacity (files
fetched per second) is measured first, and the loads are shares of it. Each request's consumer
reads its files at arrival + delta (50-500 ms); the run records, per request, how much of what
it reads was already fetched (the warm-hit ratio), how long it read, and when the method's
warm-up of it completed (replay_run.py, replay_methods.py). Every repetition runs every load,
and at each load the methods in a fresh shuffled order, each on a cold tier.

    .venv/bin/python bench/replay.py --out bench/out/replay

Needs root and FUSE (tiersim.FuseUnavailable says why not: exit 0, or 1 under
KVPREFETCH_REQUIRE_FUSE=1). Figures and the plot: docs/bench/replay.md.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import machine
import replay_methods
import replay_real
import replay_run
import replay_stream

import tiersim
from kvharness import realtier

FIGURES = ("warm_hit", "warm_hit_long_delta", "fully_warm", "fully_warm_long_delta",
           "warm_hit_new", "fully_warm_new", "fully_warm_new_on_time", "warmup_completed",
           "warmup_p50_s", "warmup_p99_s", "warmup_on_time", "read_p50_s", "read_p99_s",
           "late_p99_s")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", default="0.5,0.9,1.5", help="shares of the tier's capacity")
    p.add_argument("--methods", default=",".join(replay_methods.METHODS))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=12.0, help="the stream's length")
    p.add_argument("--drain-s", type=float, default=40.0,
                   help="after the stream, at most this long for consumers and warm-ups")
    p.add_argument("--tier", choices=replay_real.TIERS, default="tiersim")
    p.add_argument("--latency-ms", type=float, default=100.0, help="tiersim's fetch latency")
    p.add_argument("--slots", type=int, default=8, help="the tier's fetches in flight at most")
    p.add_argument("--delay-ms", type=float, default=10.0,
                   help="s3fs: the proxy's one-way delay to the S3 endpoint")
    p.add_argument("--capacity-files", type=int, default=0,
                   help="cold files read to measure the capacity (0: 12 x slots)")
    p.add_argument("--references", type=int, default=3,
                   help="requests read alone, cold then warm: the read-time references")
    p.add_argument("--head", default="1MiB", help="bytes read per file (the daemon's default)")
    spec = replay_stream.StreamSpec()
    for name in ("seed", "docs", "systems", "system_blocks", "doc_blocks", "zipf_s",
                 "warm_share", "delta_min_ms", "delta_max_ms"):
        default = getattr(spec, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--file-bytes", default=datasets.format_size(spec.file_bytes))
    p.add_argument("--order-seed", type=int, default=0)
    p.add_argument("--base", type=Path, default=datasets.DEFAULT_BASE)
    p.add_argument("--out", type=Path, required=True, help="directory for results.json")
    p.add_argument("--plot", type=Path, help="where to draw warm-hit ratio against load")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def stream_spec(args: argparse.Namespace) -> replay_stream.StreamSpec:
    return replay_stream.StreamSpec(
        seed=args.seed, docs=args.docs, systems=args.systems, system_blocks=args.system_blocks,
        doc_blocks=args.doc_blocks, zipf_s=args.zipf_s, warm_share=args.warm_share,
        delta_min_ms=args.delta_min_ms, delta_max_ms=args.delta_max_ms,
        file_bytes=datasets.parse_size(args.file_bytes))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Capacity, references, then every repetition, load and method (module docstring)."""
    methods = [m for m in args.methods.split(",") if m]
    if errors := [why for m in methods if (why := replay_methods.unknown(m))]:
        raise SystemExit("; ".join(errors))
    loads = [float(v) for v in args.loads.split(",") if v]
    if args.tier == "tiersim":
        tiersim.check_fuse()
    else:
        realtier.check_available(("s3fs",))
    spec, head = stream_spec(args), datasets.parse_size(args.head)
    population = replay_stream.Population.of(spec)
    request_bytes = spec.files_per_request * min(spec.file_bytes, head)
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="kvbench-replay-"))
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    try:
        with replay_real.mounted(args.tier, spec, args.base, workdir, args.latency_ms,
                                 args.slots, args.delay_ms) as (tier, tier_info):
            cold_docs = population.doc_files[-(args.capacity_files or 12 * max(args.slots, 8)):]
            probe = [tier.path(chain[0]) for chain in cold_docs]
            capacity = replay_run.capacity(tier, probe, head, 4 * max(args.slots, 64))
            streams = {load: replay_stream.stream(spec, load, capacity["files_per_s"],
                                                  args.duration_s,
                                                  capacity["warm_files_per_s"])
                       for load in loads}
            first = streams[loads[0]].requests
            refs = replay_run.references(tier, first[: args.references], head)
            # the fetch latency: the simulator's setting; a real tier's, from one request
            # read alone and cold, file after file
            latency_s = (args.latency_ms / 1000 if args.tier == "tiersim"
                         else refs["cold_s"] / spec.files_per_request)
            tell(args, f"capacity {capacity['files_per_s']} files/s cold, "
                       f"{capacity['warm_files_per_s']} warm; one request alone: cold "
                       f"{refs['cold_s']:.3f} s, warm {refs['warm_s']:.4f} s; fetch latency "
                       f"{latency_s * 1000:.0f} ms")
            for rep in range(args.reps):
                for position, load in enumerate(loads):
                    order = list(methods)
                    random.Random((args.order_seed * 1000 + rep) * 100 + position).shuffle(order)
                    for method in order:
                        one = replay_run.replay(streams[load], method, tier, head, workdir,
                                                args.drain_s)
                        one.update(rep=rep, order=order,
                                   summary=replay_run.summarize(one, request_bytes, latency_s))
                        runs.append(one)
                        s = one["summary"]
                        tell(args, f"rep {rep} load {load:g} {method:9s} hit "
                                   f"{s['warm_hit_long_delta']} full {s['fully_warm']} "
                                   f"new {s['fully_warm_new']} "
                                   f"warm-up p50 {s['warmup_p50_s']} p99 {s['warmup_p99_s']} "
                                   f"fetches {one['tier']['fetches']} late p99 "
                                   f"{s['late_p99_s']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        **machine.run_header("replay", started),
        "machine": machine.description(),
        "spec": {**vars(spec), "files_per_request": spec.files_per_request,
                 "population_files": len(population.files())},
        "head_bytes": head, "request_bytes": request_bytes, "tier": tier_info,
        "capacity": capacity, "references": refs, "fetch_latency_s": round(latency_s, 4),
        "streams": {str(load): {"requests": len(s.requests), "new_files": s.new_files,
                                "warm_files": len(s.warm), "offered": round(s.offered, 3),
                                "rate_per_s": round(len(s.requests) / s.duration_s, 2),
                                "duration_s": s.duration_s} for load, s in streams.items()},
        "long_delta_s": round(2 * latency_s, 4),
        "table": table(runs, loads, methods),
        "runs": runs,
    }


def table(runs: list[dict[str, Any]], loads: list[float],
          methods: list[str]) -> dict[str, dict[str, Any]]:
    """Per load and method, each figure's median over the repetitions."""
    out: dict[str, dict[str, Any]] = {}
    for load in loads:
        out[str(load)] = {}
        for method in methods:
            mine = [r["summary"] for r in runs if r["load"] == load and r["method"] == method]
            out[str(load)][method] = {
                f: (statistics.median(v) if (v := [s[f] for s in mine if s[f] is not None])
                    else None) for f in FIGURES}
    return out


def text_table(results: dict[str, Any]) -> str:
    head = ("load", "method", "hit(d>=2L)", "hit(all)", "full", "full(new)", "by delta",
            "warm-up p50", "p99", "on time", "read p50", "p99")
    lines = ["  ".join(f"{h:>11s}" for h in head)]
    for load, methods in results["table"].items():
        for method, f in methods.items():
            cells = [load, method, *(f[k] for k in (
                "warm_hit_long_delta", "warm_hit", "fully_warm", "fully_warm_new",
                "fully_warm_new_on_time", "warmup_p50_s",
                "warmup_p99_s", "warmup_on_time", "read_p50_s", "read_p99_s"))]
            lines.append("  ".join(f"{cell(c):>11}" for c in cells))
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    """The docs' table: per load and method, medians over the repetitions."""
    cols = (("warm_hit_long_delta", "warm-hit, delta >= 2L"), ("warm_hit", "warm-hit, all"),
            ("fully_warm", "fully warm, all"), ("fully_warm_new", "fully warm, new files"),
            ("fully_warm_new_on_time", "and warmed by delta"),
            ("warmup_p50_s", "warm-up p50 s"), ("warmup_p99_s", "p99 s"),
            ("warmup_completed", "completed"), ("warmup_on_time", "within delta"),
            ("read_p50_s", "read p50 s"), ("read_p99_s", "read p99 s"))
    lines = ["| load | method | " + " | ".join(t for _, t in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for load, methods in results["table"].items():
        for method, f in methods.items():
            lines.append(f"| {float(load):.0%} | {method} | "
                         + " | ".join(cell(f[k]) for k, _ in cols) + " |")
    return "\n".join(lines)


def bins_table(results: dict[str, Any]) -> str:
    """Requests bringing new files, fully warm / all, per 2 s of the stream (summed over the
    repetitions): where in the stream each method's fully warm requests are."""
    lines = [f"fully warm (new files) / requests, per {replay_run.BIN_S:g} s of arrival, "
             "all repetitions"]
    for load in results["table"]:
        for method in results["table"][load]:
            total: list[list[int]] = []
            for one in results["runs"]:
                if str(one["load"]) != load or one["method"] != method:
                    continue
                for index, (full, count) in enumerate(one["summary"]["fully_warm_new_by_bin"]):
                    total.extend([0, 0] for _ in range(index + 1 - len(total)))
                    total[index][0] += full
                    total[index][1] += count
            if total and method != "none":
                lines.append(f"{load:>5} {method:>9s}  " + " ".join(f"{a}/{b}" for a, b in total))
    return "\n".join(lines)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def plot(results: dict[str, Any], path: Path) -> None:
    """Warm-hit ratio (delta >= 2 L) and share fully warm against load, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    loads = [float(v) for v in results["table"]]
    methods = list(next(iter(results["table"].values())))
    for method in methods:
        for ax, key in zip(axes, ("warm_hit_long_delta", "fully_warm_new"), strict=True):
            ys = [results["table"][str(load)][method][key] for load in loads]
            ax.plot([100 * v for v in loads], ys, marker="o", label=method,
                    linewidth=2.5 if method == "daemon" else 1.5)
    axes[0].set_title(f"warm-hit ratio, delta >= {results['long_delta_s'] * 1000:g} ms")
    axes[1].set_title("requests bringing new files: fully warm when read")
    for ax in axes:
        ax.set_xlabel("offered load, % of the tier's measured capacity")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend()
    tier = results["tier"]
    shape = (f"{tier['slots']} slots x {tier['latency_ms']:g} ms" if tier["kind"] == "tiersim"
             else f"+{2 * tier['delay_ms']:g} ms RTT")
    fig.suptitle(f"router replay on {tier['kind']} ({shape}), capacity "
                 f"{results['capacity']['files_per_s']} files/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tell(args: argparse.Namespace, line: str) -> None:
    if not args.quiet:
        print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: daemon stops, unmount
    try:
        results = run(args)
    except (tiersim.FuseUnavailable, realtier.RealTierUnavailable) as error:
        print(f"replay: {error}", file=sys.stderr)
        required = tiersim.fuse_required() if args.tier == "tiersim" else realtier.required()
        return 1 if required else 0
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "table.md").write_text(markdown(results) + "\n\n" + bins_table(results) + "\n")
    if args.plot is not None:
        plot(results, args.plot)
    print(text_table(results))
    print("\n" + bins_table(results))
    print(f"\nresults: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
