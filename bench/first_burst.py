"""The first burst after start, against the same burst on a daemon that has run at depth.

A router's first requests after a daemon (re)start, or after a quiet spell, are the ones a
depth ramp would make late (issue 25): with a 100 ms tier and 16 reads in flight per worker
at start, 64 files took 225 ms instead of about one fetch. On the slow-tier simulator
(bench/tiersim: `--latency-ms` per first fetch of a chunk, no cap on fetch slots unless
`--slots`), per repetition, in a shuffled order:

- fresh-N: a daemon just started (READY), one `wait` request of N files;
- primed-N: a daemon that first warmed `--prime` files at depth (then made cold again), one
  `wait` request of N files;
- idle-N: the primed daemon again after `--idle-s` seconds without work;
- pool-N: N standing threads reading one head each (warmup_tools.warm_pool): the
  same-run peer, which shows this machine's floor for N heads through FUSE (its copy
  bandwidth: 64 heads of 1 MiB are 64 MiB through the kernel and the simulator).

The tier is made cold (evict-all: its chunks and the kernel's pages) before every burst.
Reported per N: the median wall time of each, fresh / primed, idle / primed and fresh /
pool, and fresh against one fetch latency. Figures, not verdicts; the targets of issue 25
(fresh within 1.2x of primed; 64 files within 1.3x of one fetch) are printed beside them.

    .venv/bin/python bench/first_burst.py --out bench/out/first_burst

Needs root and FUSE.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from warmup_tools import warm_pool

import tiersim
from kvharness.daemon import Daemon, start_config
from kvharness.wire import RawConnection

TARGETS = {"fresh_over_primed": 1.2, "small_over_fetch": 1.3}
HEAD = 1 << 20  # each file's size: one chunk of the simulator


def pool_burst(paths: list[str], head: int) -> float:
    """Seconds for len(paths) standing threads to read one head each (the warm-up
    suite's pypool-N, warmup_tools.warm_pool), every head read whole."""
    run = warm_pool(paths, head, len(paths))
    if not run["ok"]:
        raise RuntimeError(f"pool of {len(paths)}: {run['detail']}")
    return float(run["seconds"])


def make_backing(root: Path, files: int) -> list[str]:
    """files names of one chunk each (sparse: the simulator fetches, the disk holds nothing)."""
    names = [f"b{i // 256:03d}/f{i:06d}.bin" for i in range(files)]
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            handle.truncate(HEAD)
    return names


def burst(daemon: Daemon, paths: list[str], head: int = HEAD) -> float:
    """Seconds for one `wait` request over paths, every one of them read."""
    with RawConnection(daemon.socket_path, 120) as connection:
        start = time.perf_counter()
        reply = connection.call("prefetch", paths=paths, wait=True, read_bytes=head,
                                timeout_ms=60_000)
        took = time.perf_counter() - start
    outcomes = reply.get("outcomes", {})
    if not reply.get("ok") or outcomes.get("read", 0) != len(paths):
        raise RuntimeError(f"burst of {len(paths)}: {reply}")
    return took


@contextmanager
def daemon_on(mount: Path, workdir: Path, workers: int) -> Iterator[Daemon]:
    daemon = start_config(workdir, {"roots": [str(mount)], "workers": workers,
                                    "dedup_ttl_ms": 0})
    try:
        yield daemon
    finally:
        daemon.stop()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--head", type=int, default=HEAD,
                        help="bytes read of each 1 MiB file (the request's read_bytes)")
    parser.add_argument("--slots", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--prime", type=int, default=2000)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/out/first_burst"))
    parser.add_argument("--seed", type=int, default=25)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    files = args.prime + sum(args.sizes)
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="first-burst-") as scratch:
        base = Path(scratch)
        names = make_backing(base / "backing", files)
        (base / "mnt").mkdir()
        with tiersim.mount(base / "backing", base / "mnt", latency_ms=args.latency_ms,
                           slots=args.slots, chunk_bytes=HEAD) as tier:
            paths = [str(base / "mnt" / name) for name in names]
            prime, rest = paths[:args.prime], paths[args.prime:]
            sets, at = {}, 0
            for size in args.sizes:
                sets[size], at = rest[at:at + size], at + size
            for rep in range(args.reps):
                kinds = [("fresh", s) for s in args.sizes] + [("pool", s) for s in args.sizes] \
                    + [("primed", None)]
                rng.shuffle(kinds)
                for kind, size in kinds:
                    if kind == "pool":
                        assert size is not None
                        tier.evict_all()
                        runs.setdefault(f"pool-{size}", []).append(
                            pool_burst(sets[size], args.head))
                        continue
                    workdir = base / f"d{rep}-{kind}-{size}"
                    workdir.mkdir()
                    with daemon_on(base / "mnt", workdir, args.workers) as daemon:
                        if kind == "fresh":
                            assert size is not None
                            tier.evict_all()
                            runs.setdefault(f"fresh-{size}", []).append(
                                burst(daemon, sets[size], args.head))
                            continue
                        tier.evict_all()
                        burst(daemon, prime, args.head)
                        order = list(args.sizes)
                        rng.shuffle(order)
                        for size_ in order:
                            tier.evict_all()
                            runs.setdefault(f"primed-{size_}", []).append(
                                burst(daemon, sets[size_], args.head))
                        time.sleep(args.idle_s)
                        for size_ in order:
                            tier.evict_all()
                            runs.setdefault(f"idle-{size_}", []).append(
                                burst(daemon, sets[size_], args.head))
                print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                    f"{k} {v[-1] * 1000:.0f} ms" for k, v in sorted(runs.items())), flush=True)
    fetch_s = args.latency_ms / 1000
    summary: dict[str, Any] = {"latency_ms": args.latency_ms, "slots": args.slots,
                               "head": args.head,
                               "workers": args.workers, "reps": args.reps, "sizes": {}}
    for size in args.sizes:
        fresh, primed = median(runs[f"fresh-{size}"]), median(runs[f"primed-{size}"])
        idle, pool = median(runs[f"idle-{size}"]), median(runs[f"pool-{size}"])
        summary["sizes"][str(size)] = {
            "fresh_ms": fresh * 1000, "primed_ms": primed * 1000, "idle_ms": idle * 1000,
            "pool_ms": pool * 1000,
            "fresh_over_primed": fresh / primed, "idle_over_primed": idle / primed,
            "fresh_over_pool": fresh / pool, "pool_over_fetch": pool / fetch_s,
            "fresh_over_fetch": fresh / fetch_s, "primed_over_fetch": primed / fetch_s,
            "runs_ms": {k: [round(v * 1000, 1) for v in runs[f"{k}-{size}"]]
                        for k in ("fresh", "primed", "idle", "pool")}}
        row = summary["sizes"][str(size)]
        print(f"{size:5d} files: fresh {fresh * 1000:6.0f} ms, primed {primed * 1000:6.0f} ms, "
              f"idle {idle * 1000:6.0f} ms; fresh/primed {row['fresh_over_primed']:.2f}x "
              f"(target <= {TARGETS['fresh_over_primed']}), idle/primed "
              f"{row['idle_over_primed']:.2f}x, fresh/pool {row['fresh_over_pool']:.2f}x, "
              f"fresh/fetch {row['fresh_over_fetch']:.2f}x (pool/fetch "
              f"{row['pool_over_fetch']:.2f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"first-burst-{args.head >> 10}KiB.json").write_text(json.dumps(
        {"targets": TARGETS, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
