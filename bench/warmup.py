"""Warm-up time of the heads of a cold set: kvprefetchd's engines against fio, vmtouch & co.

What is compared, on the same files, in the same run:
- kvprefetchd-<engine>: the daemon through its socket, `prefetch` with `wait`. One daemon
  per engine is started once and reused for every repetition. The paths go as
  pipelined requests of --chunk-paths (default 1000) on one connection: that is how a
  router would hand over a big set, and it lets the single-threaded supervisor decode
  chunk k+1 while the workers already read chunk k (--chunk-paths 0: one request).
- vmtouch: `vmtouch -t -q -p 0-HEAD -b LIST` (mmap + one load per page; -p takes a
  range, "0-1M" or "-1M"). A page fault reads around the fault (mm/filemap.c
  do_sync_mmap_readahead: ra_pages, 8 MiB here), so it may bring in more than asked.
- fio: ioengine=io_uring, iodepth=128, bs=min(1M, HEAD), one job over every file
  (filename= lists, see fio_jobfile), reading exactly [0, HEAD) of each file.
  fadvise_hint=random, as the daemon's FADV_RANDOM, so fio reads what it is asked and
  no readahead window (the default hint would be SEQUENTIAL: 2x the 8 MiB window).
  invalidate=0: the set is made cold by us and verified; invalidate=1 would add an
  fadvise(DONTNEED) per file to fio's time.
- fio-direct: the device's ceiling, not a warmer: fio's job with direct=1 and iodepth=256
  (O_DIRECT: no page cache, no readahead, the device queue full). No warmer can beat what
  the disk serves; its `x fio` bounds every `x fio` target here. Caches nothing.
- uring_heads: bench/c/uring_heads.c (when present), the hand-written liburing
  program: `-m read -b HEAD -q 128 -R` (1 MiB requests, FADV_RANDOM).
- pypool-16 / pypool-32: a Python thread pool (16: the seed's Go plugin design, 16
  workers fed through a queue of 256; 32: more threads) of open + FADV_RANDOM + pread.
- none: no warm-up; only the consumer read on the cold set (the baseline).

--workers 2,1 also runs each engine's daemon with 1 worker, as kvprefetchd-<engine>-1w.
--state warm runs every method on a set whose heads were read and verified resident
just before it (instead of cold): how fast is the skip. The daemon's dedup memory
is off in that state, so each file pays the real residency check.

Every repetition runs every method in a freshly shuffled order, each on a set made
cold just before it (drop_caches + settle as root, see cold.py), because on this VM
absolute times drift with the host: ratios between methods of the same repetition
are what to read. After each warm-up a *consumer* preads every head in one thread,
timed: warm-up + consumer read is what a reader of the files sees.

Also recorded per run: whole-file page-cache residency of a sample (cachestat) right
after the warm-up, against the bytes asked; bytes read from the disk (block-device
stat); CPU seconds of the method (daemon: its workers and supervisor via psutil,
tools: rusage of the child, Python pools: this process), and system-wide busy CPU
so a run disturbed by someone else shows.

    .venv/bin/python bench/warmup.py --dataset 2000x4MiB --reps 5 --out bench/out/x

This file is the command line and the run's order; the parts: warmup_methods.py (the
methods by name), warmup_daemon.py (kvprefetchd's daemons and their warm-up),
warmup_tools.py (fio, vmtouch, uring_heads, the pools), warmup_measure.py (one run and
what disturbed it), warmup_summary.py (medians, paired ratios, the table), machine.py
(disk, drop_caches and CPU of the machine) and cold.py (the cold state).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import cold
import datasets
import machine
import psutil
from machine import disk_stat_path
from warmup_daemon import EngineDaemon, make_prefetcher, start_engine_daemon
from warmup_measure import measure
from warmup_methods import ENGINES, Env, all_methods, chosen_methods, daemon_method
from warmup_summary import fmt, summarize, table
from warmup_tools import (
    DEVICE_REFERENCE,
    DIRECT_DEPTH,
    availability,
    build_uring_heads,
    fio_jobfile,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Methods: " + ", ".join(all_methods(ENGINES)) + ". Read the module docstring "
        "for what each does and why.")
    parser.add_argument("--dataset", default="200x4MiB", help="COUNTxSIZE (default %(default)s)")
    parser.add_argument("--seed", type=int, default=datasets.DEFAULT_SEED)
    parser.add_argument("--base", type=Path, default=datasets.DEFAULT_BASE,
                        help="where datasets live (default %(default)s)")
    parser.add_argument("--head", default="1MiB",
                        help="bytes to warm per file, or 'whole' (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="daemon engines to compare (default %(default)s)")
    parser.add_argument("--methods", default="all",
                        help="comma-separated subset of the methods (default: all)")
    parser.add_argument("--workers", default="2",
                        help="daemon workers; a list (2,1) also runs each engine with the "
                        "others, as kvprefetchd-<engine>-<n>w (default %(default)s)")
    parser.add_argument("--state", choices=("cold", "warm"), default="cold",
                        help="cold: each method starts on a set verified cold; warm: on a "
                        "set whose heads are verified resident (the skip; the daemon's "
                        "dedup memory is off so it checks residency every time)")
    parser.add_argument("--chunk-paths", type=int, default=1000,
                        help="paths per pipelined request (0: one request; default 1000)")
    parser.add_argument("--client", choices=("auto", "kvprefetch", "raw"), default="auto",
                        help="who talks to the daemon (auto: kvprefetch if importable)")
    parser.add_argument("--cold", choices=("auto", "drop", "fadvise"), default="auto",
                        help="how to make the set cold before each method (see cold.py)")
    parser.add_argument("--settle", type=float, default=cold.DEFAULT_SETTLE,
                        help="seconds to wait after evicting (default %(default)s)")
    parser.add_argument("--residency-sample", type=int, default=1000,
                        help="files whose residency is read after each warm-up (0: all)")
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="before each run, wait up to this long for an idle disk and no "
                        "foreign drop_caches (0: don't; default %(default)s)")
    parser.add_argument("--retries", type=int, default=2,
                        help="re-runs of a run that someone else disturbed (default 2)")
    parser.add_argument("--retry-minutes", type=float, default=8.0,
                        help="no more re-runs once the benchmark has run this long "
                        "(default %(default)s)")
    parser.add_argument("--order-seed", type=int, default=0,
                        help="seed of the per-repetition shuffle")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser.parse_args(argv)


OnRun = Callable[[str, int, dict[str, Any]], None]


def run(args: argparse.Namespace, on_run: OnRun | None = None) -> dict[str, Any]:
    """Every repetition of every method; the results (see module docstring). on_run is
    called after each kept run with (method, repetition, run), for progress displays."""
    ds = datasets.dataset(args.dataset, args.seed, args.base)
    paths = datasets.ensure(ds, quiet=args.quiet)
    head = ds.size if args.head == "whole" else datasets.parse_size(args.head)
    if head > ds.size:
        raise SystemExit(f"--head {args.head} is larger than the smallest file "
                         f"({ds.size} bytes)")
    if args.head == "whole" and ds.mixed:
        raise SystemExit("--head whole needs files of one size")
    engines = [e for e in args.engines.split(",") if e]
    worker_counts = [int(w) for w in str(args.workers).split(",") if w]
    known = all_methods(engines, worker_counts)
    unknown = {m for m in args.methods.split(",") if m} - {"all", *known}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {known}")
    methods = chosen_methods(known, args.methods)
    args.out.mkdir(parents=True, exist_ok=True)
    skipped = {m: why for m in methods if (why := availability(m)) is not None}
    if args.state == "warm" and DEVICE_REFERENCE in methods:
        skipped[DEVICE_REFERENCE] = "the device's ceiling is a cold read; this set is warm"
    active = [m for m in methods if m not in skipped]
    client_kind, prefetch = make_prefetcher(args.client)
    sample = cold.sample(paths, args.residency_sample, args.seed)
    stat = disk_stat_path(paths[0])
    say = (lambda _text: None) if args.quiet else (lambda text: print(text, file=sys.stderr))

    workdir = Path(tempfile.mkdtemp(prefix="kvbench-"))
    daemons: dict[str, EngineDaemon] = {}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    orders: list[list[str]] = []
    cold_reports: list[dict[str, Any]] = []
    started = time.time()
    try:
        list_file = workdir / "paths.txt"
        list_file.write_text("\n".join(paths) + "\n")
        uring_heads = None
        if "uring_heads" in active:
            try:
                uring_heads = build_uring_heads(workdir)
            except subprocess.CalledProcessError as error:
                skipped["uring_heads"] = f"does not build: {error.stderr.strip()[-300:]}"
                active.remove("uring_heads")
        env = Env(
            paths=paths, head=head, workdir=workdir, list_file=list_file,
            fio_job=fio_jobfile(paths, head, ds.model_dir, workdir / "heads.fio")
            if "fio" in active else None,
            fio_direct_job=fio_jobfile(paths, head, ds.model_dir, workdir / "direct.fio",
                                       iodepth=DIRECT_DEPTH, direct=True)
            if DEVICE_REFERENCE in active else None,
            uring_heads=uring_heads,
            daemons=daemons, prefetch=prefetch, chunk_paths=args.chunk_paths,
            state=args.state)
        for engine in engines:
            for workers in worker_counts:
                method = daemon_method(engine, workers, worker_counts[0])
                if method in active:
                    daemons[method] = start_engine_daemon(
                        engine, ds.root, head, len(paths), workers, workdir, args.out,
                        dedup=args.state == "cold")
        for rep in range(args.reps):
            order = list(active)
            random.Random(args.order_seed * 1000 + rep).shuffle(order)
            orders.append(order)
            for position, method in enumerate(order):
                discarded: list[dict[str, Any]] = []
                while True:
                    one = measure(env, method, args, stat, sample, rep)
                    one["position"] = position
                    out_of_time = time.time() - started > args.retry_minutes * 60
                    if not one["interference"] or len(discarded) >= args.retries \
                            or out_of_time:
                        break
                    discarded.append(one)
                    say(f"rep {rep} #{position} {method:22s} disturbed "
                        f"({'; '.join(one['interference'])}): again")
                one["discarded"] = discarded
                cold_reports.append({"rep": rep, "method": method, **one.pop("cold_report")})
                for attempt in discarded:
                    attempt.pop("cold_report", None)
                runs[method].append(one)
                note = "; ".join(one["interference"])
                say(f"rep {rep} #{position} {method:22s} warm "
                    f"{fmt(one['warm_s'], '.3f')} s  consumer {one['consumer_s']:.3f} s"
                    f"{'' if one['ok'] else '  (!) ' + json.dumps(one['detail'])}"
                    f"{'  disturbed: ' + note if note else ''}")
                if on_run is not None:
                    on_run(method, rep, one)
    finally:
        for daemon in daemons.values():
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    return {
        **machine.run_header("warmup", started),
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(),
                    "mem_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
                    "loadavg_at_start": os.getloadavg(), "euid": os.geteuid()},
        "dataset": {"name": ds.name, "root": str(ds.root), "files": len(paths),
                    "file_bytes": ds.size, "total_file_bytes": ds.total_bytes,
                    "mixed": ds.mixed, "seed": ds.seed},
        "state": args.state,
        "head_bytes": head,
        "reps": args.reps,
        "workers": worker_counts[0],
        "worker_counts": worker_counts,
        "chunk_paths": args.chunk_paths,
        "client": client_kind,
        "cold": {"method": args.cold if args.state == "cold" else "none: the warm state",
                 "settle_s": args.settle, "checks": cold_reports},
        "orders": orders,
        "ratios": "paired: the median over repetitions of method/reference in the same "
                  "repetition; below 1 is faster than the reference",
        "methods": summarize(methods, runs, len(paths), head, skipped),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the daemons we started are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{results['dataset']['name']} ({results['state']}), head "
          f"{datasets.format_size(results['head_bytes'])}, {args.reps} reps, "
          f"{args.workers} workers, client {results['client']}, cold {args.cold} "
          f"(settle {args.settle:g} s); medians, ratios paired per repetition:")
    print(table(results))
    print(f"\nresults: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
