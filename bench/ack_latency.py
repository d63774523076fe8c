"""Acknowledgement latency of fire-and-forget `prefetch` requests, against an echo floor.

A router calls the daemon on its request path, so what matters there is how long
the *ack* of a non-`wait` prefetch takes: decode, confine and shard the paths,
queue them, answer. No I/O is waited for, so the paths need not exist: they are
laid out as the fs connector would write them under the daemon's root, and the
workers settle them as `missing` in the background.

The floor is an echo server in its own process (echo_floor.py): the same framing, a
selector loop like the supervisor's, msgpack decode of the request and a small reply
with the same counts. daemon/echo is what the daemon's own work costs on top of
Python + a Unix socket + msgpack.

Both are measured with the raw speaker (kvharness.wire) and with the `kvprefetch`
sync client, closed loop, one request in flight. Sizes run one after another; in each,
the (target, client) pairs take turns in shuffled blocks so drift hits all alike. Two
modes, because on a small machine the workers compete with the supervisor for CPU:
- busy: the daemon's queues are drained (stats: files.in_flight == 0) before each
  block only; during it the workers settle earlier requests' paths, as they would be
  warming files in production.
- idle: drained before every request, then a pause (--idle-gap) before it, for the
  echo floor too: the ack alone, workers asleep. On this VM waking an idle vCPU costs
  ~0.1-0.3 ms per round trip (measured on the echo floor alone), so idle acks are
  slower than busy ones; the pause puts daemon and floor on the same footing.
queue_limit is raised so a backlog never drops a file, and every ack is checked for
dropped == 0. Two path sets (--paths), each against a daemon of its own: `absent` (the
above) and `resident`, 1,000 real files read and verified resident before each block, which
the workers probe right after the ack (dedup off). Each request also records how long the
client waited for a CPU (schedstat): the workers' share of the ack shows there.

    .venv/bin/python bench/ack_latency.py --out bench/out/ack

This file is the command line, the run and its report; ack_measure.py sends and
times, echo_floor.py is the floor.
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
from pathlib import Path
from typing import Any

import machine
import psutil
from ack_measure import (
    SENDERS,
    Blocks,
    apply_worker_sched,
    drain,
    fake_paths,
    make_resident,
    resident_files,
    summarize,
)
from echo_floor import serve_echo, start_echo, stop_echo
from machine import busy_cpu_seconds
from percentiles import nearest_rank
from warmup_daemon import start_engine_daemon

from kvharness.wire import RawConnection

DEFAULT_SIZES = "1,100,1000"
DEFAULT_REQUESTS = "2000,1000,1000"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for results.json")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="paths per request")
    parser.add_argument("--requests", default=DEFAULT_REQUESTS,
                        help="timed requests per size, per target and client")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests per block run")
    parser.add_argument("--blocks", type=int, default=5,
                        help="blocks each (target, client) pair's requests are split into")
    parser.add_argument("--clients", default="raw,kvprefetch")
    parser.add_argument("--modes", default="busy,idle", help="busy, idle or both (see above)")
    parser.add_argument("--idle-gap", type=float, default=0.002,
                        help="idle mode: seconds of pause before each request")
    parser.add_argument("--paths", default="absent,resident",
                        help="path sets, in order: absent, resident (see ack_measure.py)")
    parser.add_argument("--resident-files", type=int, default=1000,
                        help="files in the resident set (requests take them in turn)")
    parser.add_argument("--resident-bytes", type=int, default=16 * 1024,
                        help="size of each resident file")
    parser.add_argument("--worker-sched",
                        choices=("default", "batch", "idle", "nice0", "nice10", "nice19"),
                        default="default",
                        help="experiment: scheduling policy forced on the daemon's workers")
    parser.add_argument("--engine", default="io_uring")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--base", type=Path, default=Path("/var/tmp/kvbench"),
                        help="where the daemon's (empty) root is made")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--serve-echo", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_echo is None and args.out is None:
        parser.error("--out is required")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the daemons we started are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.serve_echo:  # the floor alone (echo_floor.py SOCKET does the same)
        serve_echo(args.serve_echo)
        return 0
    out = run(args)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    print(f"\nresults: {args.out / 'results.json'}")
    return 0 if out["daemon"]["dropped"] == 0 else 1


PATH_SETS = {
    "absent": "paths that do not exist: each worker settles them as missing (a few us each)",
    "resident": "real files read and verified resident before each block: each worker probes "
                "them natively (~11 us a file here) right after the ack; dedup off, so every "
                "request is probed",
}


def run(args: argparse.Namespace,
        on_step: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Every path set, mode and size; the results. on_step(mode, size) after each, for
    progress. `modes` is the first path set's (report.py reads it); `path_sets` has all."""
    sizes = [int(x) for x in args.sizes.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != len(sizes):
        raise SystemExit("--requests needs one count per --sizes entry")
    sets = [p for p in args.paths.split(",") if p]
    if not sets or any(p not in PATH_SETS for p in sets):
        raise SystemExit(f"--paths: a list of {', '.join(PATH_SETS)}")
    clients = [c for c in args.clients.split(",") if c]
    skipped: dict[str, str] = {}
    if "kvprefetch" in clients:
        try:
            import kvprefetch  # noqa: F401
        except ImportError as error:
            skipped["kvprefetch"] = f"skipped: kvprefetch not importable ({error})"
            clients.remove("kvprefetch")
    args.out.mkdir(parents=True, exist_ok=True)
    args.base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvack-"))
    root = Path(tempfile.mkdtemp(prefix="ack-root-", dir=args.base))
    echo_sock = str(workdir / "echo.sock")
    echo = start_echo(echo_sock)
    started = time.time()
    per_set: dict[str, Any] = {}
    try:
        for name in sets:
            per_set[name] = run_set(args, name, sizes, counts, clients, root, workdir,
                                    echo_sock, echo.pid, on_step)
    finally:
        stop_echo(echo)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    first = per_set[sets[0]]
    return {
        **machine.run_header("ack_latency", started),
        "machine": machine.description(),
        # the first set's daemon and modes, as before path sets (report.py, plots.py)
        "daemon": {**first["daemon"],
                   "dropped": sum(s["daemon"]["dropped"] for s in per_set.values())},
        "floor": "echo server: same framing, selector loop, msgpack decode, small reply",
        "percentiles": "nearest rank, microseconds, send start to reply parsed",
        "clients": clients,
        "skipped": skipped,
        "paths": sets,
        "modes": first["modes"],
        "path_sets": per_set,
        "p99_ratio": {name: {mode: {size: {c: round(e[c]["ratio_daemon_to_echo"]["p99_us"], 2)
                                           for c in clients}
                                    for size, e in m["sizes"].items()}
                             for mode, m in s["modes"].items()}
                      for name, s in per_set.items()},
    }


def tell_pids(name: str, supervisor: int, echo: int) -> None:
    """For ack_trace.py: who is who in a scheduler trace of this run (the client is this
    process's main thread), appended to $KVBENCH_ACK_PIDS as one JSON line per path set."""
    path = os.environ.get("KVBENCH_ACK_PIDS")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"set": name, "client": os.getpid(),
                                  "supervisor": supervisor, "echo": echo}) + "\n")


def run_set(args: argparse.Namespace, name: str, sizes: Sequence[int], counts: Sequence[int],
            clients: Sequence[str], root: Path, workdir: Path, echo_sock: str, echo_pid: int,
            on_step: Callable[[str, int], None] | None) -> dict[str, Any]:
    """One path set against a daemon of its own and the shared echo floor."""
    resident = name == "resident"
    if resident:
        pool = resident_files(root, max(args.resident_files, *sizes), args.resident_bytes,
                              args.seed)
    else:
        pool = fake_paths(root, max(sizes) * 10, args.seed)
    # The most a block can leave queued: drained before each block, never dropped.
    backlog = (args.warmup + max(counts)) * max(sizes)
    daemon = start_engine_daemon(args.engine, root, 1 << 20, backlog, args.workers, workdir,
                                 args.out, dedup=not resident, name=f"ack-{name}")
    apply_worker_sched(daemon, args.worker_sched)
    tell_pids(name, daemon.daemon.process.pid, echo_pid)
    targets = {"daemon": daemon.socket, "echo": echo_sock}
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, Any] = {mode: {} for mode in modes}
    cpu0 = daemon.cpu()
    echo_process = psutil.Process(echo_pid)

    def own_cpu() -> float:
        """CPU of this process, the echo server and the daemon (workers included)."""
        total = sum(daemon.cpu())
        for proc in (psutil.Process(), echo_process):
            t = proc.cpu_times()
            total += t.user + t.system
        return float(total)

    try:
        made = {(t, c): SENDERS[c](sock) for t, sock in targets.items() for c in clients}
        poller = RawConnection(daemon.socket, timeout=30)

        def idle_now() -> None:
            while poller.call_ok("stats")["stats"]["files"]["in_flight"] > 0:
                time.sleep(0.0005)

        blocks = Blocks({pair: send for pair, (send, _) in made.items()}, daemon, pool,
                        args.warmup, args.idle_gap, idle_now, random.Random(args.seed),
                        prepare=(lambda: make_resident(pool)) if resident else None)
        for mode in modes:
            for size, count in zip(sizes, counts, strict=True):
                wall0, busy0, own0 = time.monotonic(), busy_cpu_seconds(), own_cpu()
                samples = blocks.run(mode, size, count, args.blocks)
                wall = time.monotonic() - wall0
                foreign = max(0.0, busy_cpu_seconds() - busy0 - (own_cpu() - own0))
                results[mode][str(size)] = size_entry(samples, blocks.run_delay, clients,
                                                      count, foreign, wall)
                if on_step is not None:
                    on_step(mode, size)
                else:
                    print(f"{name} {mode}: {size} paths done", file=sys.stderr)
        poller.close()
        blocks.drained_s += drain(daemon)
        cpu1 = daemon.cpu()
        stats = daemon.stats()
        for _, close in made.values():
            close()
    finally:
        daemon.stop()
    probed = {k: sum(w.get(k, 0) for w in stats.get("workers", []))
              for k in ("probed_resident", "probed_missing")}
    return {
        "what": PATH_SETS[name],
        "daemon": {"engine": args.engine, "workers": args.workers,
                   "worker_sched": args.worker_sched,
                   "dropped": blocks.dropped, "files": stats["files"], "probed": probed,
                   "reread_to_stay_resident": blocks.reread,
                   "workers_cpu_s": round(cpu1[0] - cpu0[0], 3),
                   "supervisor_cpu_s": round(cpu1[1] - cpu0[1], 3),
                   "drained_between_blocks_s": round(blocks.drained_s, 3)},
        "modes": {
            mode: {"what": {"busy": "queues drained before each block only: workers settle "
                            "earlier paths meanwhile",
                            "idle": "queues drained and --idle-gap s of pause before every "
                            "request, daemon and echo alike"}[mode],
                   "sizes": results[mode]}
            for mode in modes},
    }


def size_entry(samples: dict[tuple[str, str], list[int]],
               run_delay: dict[tuple[str, str], list[int]], clients: Sequence[str], count: int,
               foreign: float, wall: float) -> dict[str, Any]:
    """One size's figures: per client and target, and the daemon/echo ratios."""
    entry: dict[str, Any] = {
        "requests": count,
        # CPU that other processes took meanwhile, as a share of the machine
        "foreign_cpu_share": round(foreign / (wall * (os.cpu_count() or 1)), 3),
    }
    for (target, client), values in samples.items():
        entry.setdefault(client, {})[target] = summarize(values)
        waited = sorted(w / 1000 for w in run_delay.get((target, client), []) if w >= 0)
        if waited:  # the client's wait for a CPU during each request (schedstat)
            entry[client][target]["client_run_delay_us"] = {
                "p50": nearest_rank(waited, 50), "p99": nearest_rank(waited, 99),
                "max": waited[-1]}
    for client in clients:
        d, e = entry[client]["daemon"], entry[client]["echo"]
        entry[client]["ratio_daemon_to_echo"] = {
            k: d[k] / e[k] for k in ("p50_us", "p99_us", "p999_us")}
    return entry


def table(out: dict[str, Any]) -> str:
    rows = [("set", "mode", "paths", "client", "daemon p50", "p99", "p999", "echo p50", "p99",
             "p999", "x echo p50", "p99", "p999", "run delay p99", "others' CPU")]
    for name, per_set in out["path_sets"].items():
        for mode, per_mode in per_set["modes"].items():
            for size, entry in per_mode["sizes"].items():
                for client in out["clients"]:
                    d, e, r = (entry[client]["daemon"], entry[client]["echo"],
                               entry[client]["ratio_daemon_to_echo"])
                    delay = d.get("client_run_delay_us", {}).get("p99")
                    rows.append((name, mode, size, client,
                                 *(f"{d[k]:.0f}" for k in ("p50_us", "p99_us", "p999_us")),
                                 *(f"{e[k]:.0f}" for k in ("p50_us", "p99_us", "p999_us")),
                                 *(f"{r[k]:.1f}" for k in ("p50_us", "p99_us", "p999_us")),
                                 "-" if delay is None else f"{delay:.0f}",
                                 f"{100 * entry['foreign_cpu_share']:.0f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    daemon = out["daemon"]
    lines.append(f"(µs; dropped {daemon['dropped']}; daemon workers CPU "
                 f"{daemon['workers_cpu_s']} s, supervisor {daemon['supervisor_cpu_s']} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
