"""Acknowledgement latency of fire-and-forget `prefetch` requests, against an echo floor.

A router calls the daemon on its request path, so what matters there is how long
the *ack* of a non-`wait` prefetch takes: decode, confine and shard the paths,
queue them, answer. No I/O is waited for, so the paths need not exist: they are
laid out as the fs connector would write them under the daemon's root, and the
workers settle them as `missing` in the background.

The floor is an echo server in its own process (this file, --serve-echo): the same
framing, a selector loop like the supervisor's, msgpack decode of the request and a
small reply with the same counts. daemon/echo is what the daemon's own work costs
on top of Python + a Unix socket + msgpack.

Both are measured with the raw speaker (bench/kvproto.py) and with the `kvprefetch`
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
dropped == 0.

    .venv/bin/python bench/ack_latency.py --out bench/out/ack
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import random
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import msgpack
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvproto
from warmup import Daemon, busy_cpu_seconds, start_daemon

DEFAULT_SIZES = "1,100,1000"
DEFAULT_REQUESTS = "2000,1000,1000"


# ---- the echo floor -----------------------------------------------------------------------


def serve_echo(path: str) -> None:
    """Answer every frame with {id, ok, accepted, dropped, rejected}: framing + msgpack only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    buffers: dict[socket.socket, bytearray] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ)
                buffers[conn] = bytearray()
                continue
            conn = cast(socket.socket, key.fileobj)
            try:
                data = conn.recv(256 * 1024)
            except BlockingIOError:
                continue
            if not data:
                selector.unregister(conn)
                conn.close()
                del buffers[conn]
                continue
            buf = buffers[conn]
            buf += data
            out = bytearray()
            while len(buf) >= 4:
                (length,) = kvproto.HEADER.unpack_from(buf)
                if len(buf) < 4 + length:
                    break
                message = msgpack.unpackb(bytes(buf[4 : 4 + length]), raw=False)
                del buf[: 4 + length]
                paths = message.get("paths") or []
                out += kvproto.pack_frame({"id": message.get("id"), "ok": True,
                                           "accepted": len(paths), "dropped": 0, "rejected": 0})
            if out:
                conn.setblocking(True)  # replies are small: block rather than buffer
                conn.sendall(out)
                conn.setblocking(False)


def start_echo(path: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, __file__, "--serve-echo", path],
                               start_new_session=True)
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the echo server did not start")
        time.sleep(0.01)
    return process


# ---- measuring ----------------------------------------------------------------------------


def fake_paths(root: Path, count: int, seed: int) -> list[str]:
    """Paths in the fs connector's layout under root that do not exist (nothing to read)."""
    base = root / "Qwen_Qwen3-8B_000000000000_r0"
    out = []
    for index in range(count):
        h = hashlib.sha256(f"ack:{seed}:{index}".encode()).hexdigest()
        out.append(str(base / h[0:3] / f"{h[3:5]}_g0" / f"{h}.bin"))
    return out


Sender = Callable[[list[str]], dict[str, int]]


def raw_sender(sock: str) -> tuple[Sender, Callable[[], None]]:
    client = kvproto.RawClient(sock, timeout=30)

    def send(paths: list[str]) -> dict[str, int]:
        reply = client.call("prefetch", paths=paths)
        return {"accepted": reply["accepted"], "dropped": reply["dropped"]}

    return send, client.close


def kvprefetch_sender(sock: str) -> tuple[Sender, Callable[[], None]]:
    from kvprefetch import Client

    client = Client(sock, timeout=30)

    def send(paths: list[str]) -> dict[str, int]:
        ack = client.prefetch(paths)
        return {"accepted": ack.accepted, "dropped": ack.dropped}

    return send, client.close


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: p999 of 1000 samples is the maximum)."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


CDF_POINTS = (*range(0, 100, 2), 99, 99.5, 99.9, 100)


def summarize(samples_ns: list[int]) -> dict[str, Any]:
    """Percentiles, and the CDF at CDF_POINTS (percent -> µs) for plots."""
    us = sorted(s / 1000 for s in samples_ns)
    return {"n": len(us), "p50_us": percentile(us, 0.50), "p99_us": percentile(us, 0.99),
            "p999_us": percentile(us, 0.999), "mean_us": statistics.fmean(us),
            "max_us": us[-1],
            "cdf_us": [[q, round(percentile(us, q / 100) if q else us[0], 1)]
                       for q in CDF_POINTS]}


def drain(daemon: Daemon, limit: float = 120.0) -> float:
    """Wait until the daemon has settled every queued file; returns the seconds waited."""
    started = time.monotonic()
    while daemon.stats()["files"]["in_flight"] > 0:
        if time.monotonic() - started > limit:
            raise RuntimeError(f"the daemon did not drain its queues in {limit:.0f} s")
        time.sleep(0.02)
    return time.monotonic() - started


def apply_worker_sched(daemon: Daemon, policy: str) -> None:
    """An experiment, not a daemon setting: how much of the ack's cost is the workers
    preempting the supervisor? SCHED_BATCH tasks never preempt on wake-up (sched(7));
    nice 10 gives them a smaller CPU share."""
    for pid in daemon.worker_pids:
        if policy == "batch":
            os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))
        elif policy == "nice10":
            os.setpriority(os.PRIO_PROCESS, pid, 10)


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
    parser.add_argument("--worker-sched", choices=("default", "batch", "nice10"),
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
    if args.serve_echo:
        serve_echo(args.serve_echo)
        return 0
    out = run(args)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    print(f"\nresults: {args.out / 'results.json'}")
    return 0 if out["daemon"]["dropped"] == 0 else 1


def run(args: argparse.Namespace,
        on_step: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Every mode and size; the results. on_step(mode, size) after each, for progress."""
    sizes = [int(x) for x in args.sizes.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != len(sizes):
        raise SystemExit("--requests needs one count per --sizes entry")
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
    pool = fake_paths(root, max(sizes) * 10, args.seed)
    # The most a block can leave queued: drained before each block, never dropped.
    backlog = (args.warmup + max(counts)) * max(sizes)
    daemon = start_daemon(args.engine, root, 1 << 20, backlog, args.workers, workdir, args.out)
    apply_worker_sched(daemon, args.worker_sched)
    echo_sock = str(workdir / "echo.sock")
    echo = start_echo(echo_sock)
    makers = {"raw": raw_sender, "kvprefetch": kvprefetch_sender}
    targets = {"daemon": daemon.socket, "echo": echo_sock}
    rng = random.Random(args.seed)
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, Any] = {mode: {} for mode in modes}
    dropped = 0
    drained_s = 0.0
    cpu0 = daemon.cpu()
    started = time.time()
    echo_process = psutil.Process(echo.pid)

    def own_cpu() -> float:
        """CPU of this process, the echo server and the daemon (workers included)."""
        total = sum(daemon.cpu())
        for proc in (psutil.Process(), echo_process):
            t = proc.cpu_times()
            total += t.user + t.system
        return float(total)

    try:
        senders = {(t, c): makers[c](sock) for t, sock in targets.items() for c in clients}
        poller = kvproto.RawClient(daemon.socket, timeout=30)

        def idle_now() -> None:
            while poller.call("stats")["stats"]["files"]["in_flight"] > 0:
                time.sleep(0.0005)

        for mode in modes:
            for size, count in zip(sizes, counts, strict=True):
                wall0, busy0, own0 = time.monotonic(), busy_cpu_seconds(), own_cpu()
                samples: dict[tuple[str, str], list[int]] = {pair: [] for pair in senders}
                cursor = 0
                per_block = [count // args.blocks + (i < count % args.blocks)
                             for i in range(args.blocks)]
                for block in per_block:
                    order = list(senders)
                    rng.shuffle(order)
                    for pair in order:
                        send = senders[pair][0]
                        drained_s += drain(daemon)
                        for index in range(args.warmup + block):
                            batch = [pool[(cursor + k) % len(pool)] for k in range(size)]
                            cursor += size
                            if mode == "idle":
                                idle_now()  # the daemon's workers asleep, for either target
                                time.sleep(args.idle_gap)  # and so is the target itself
                            t0 = time.perf_counter_ns()
                            ack = send(batch)
                            elapsed = time.perf_counter_ns() - t0
                            if ack["accepted"] + ack["dropped"] != size:
                                raise RuntimeError(f"{pair}: ack {ack} for {size} paths")
                            dropped += ack["dropped"]
                            if index >= args.warmup:
                                samples[pair].append(elapsed)
                wall = time.monotonic() - wall0
                foreign = max(0.0, busy_cpu_seconds() - busy0 - (own_cpu() - own0))
                entry: dict[str, Any] = {
                    "requests": count,
                    # CPU that other processes took meanwhile, as a share of the machine
                    "foreign_cpu_share": round(foreign / (wall * (os.cpu_count() or 1)), 3),
                }
                for (target, client), values in samples.items():
                    entry.setdefault(client, {})[target] = summarize(values)
                for client in clients:
                    d, e = entry[client]["daemon"], entry[client]["echo"]
                    entry[client]["ratio_daemon_to_echo"] = {
                        k: d[k] / e[k] for k in ("p50_us", "p99_us", "p999_us")}
                results[mode][str(size)] = entry
                if on_step is not None:
                    on_step(mode, size)
                else:
                    print(f"{mode}: {size} paths done", file=sys.stderr)
        poller.close()
        drained_s += drain(daemon)
        cpu1 = daemon.cpu()
        stats = daemon.stats()
        for _, close in senders.values():
            close()
    finally:
        daemon.stop()
        echo.send_signal(signal.SIGTERM)
        echo.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    out: dict[str, Any] = {
        "benchmark": "ack_latency",
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(),
                    "loadavg_at_start": os.getloadavg()},
        "daemon": {"engine": args.engine, "workers": args.workers,
                   "worker_sched": args.worker_sched,
                   "dropped": dropped, "files": stats["files"],
                   "workers_cpu_s": round(cpu1[0] - cpu0[0], 3),
                   "supervisor_cpu_s": round(cpu1[1] - cpu0[1], 3),
                   "drained_between_blocks_s": round(drained_s, 3)},
        "floor": "echo server: same framing, selector loop, msgpack decode, small reply",
        "percentiles": "nearest rank, microseconds, send start to reply parsed",
        "clients": clients,
        "skipped": skipped,
        "modes": {
            mode: {"what": {"busy": "queues drained before each block only: workers settle "
                            "earlier paths meanwhile",
                            "idle": "queues drained and --idle-gap s of pause before every "
                            "request, daemon and echo alike"}[mode],
                   "sizes": results[mode]}
            for mode in modes},
    }
    return out


def table(out: dict[str, Any]) -> str:
    rows = [("mode", "paths", "client", "daemon p50", "p99", "p999", "echo p50", "p99", "p999",
             "x echo p50", "p99", "p999", "others' CPU")]
    for mode, per_mode in out["modes"].items():
        for size, entry in per_mode["sizes"].items():
            for client in out["clients"]:
                d, e, r = (entry[client]["daemon"], entry[client]["echo"],
                           entry[client]["ratio_daemon_to_echo"])
                rows.append((mode, size, client,
                             *(f"{d[k]:.0f}" for k in ("p50_us", "p99_us", "p999_us")),
                             *(f"{e[k]:.0f}" for k in ("p50_us", "p99_us", "p999_us")),
                             *(f"{r[k]:.1f}" for k in ("p50_us", "p99_us", "p999_us")),
                             f"{100 * entry['foreign_cpu_share']:.0f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    daemon = out["daemon"]
    lines.append(f"(µs; dropped {daemon['dropped']}; daemon workers CPU "
                 f"{daemon['workers_cpu_s']} s, supervisor {daemon['supervisor_cpu_s']} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
