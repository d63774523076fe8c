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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cold
import datasets
import kvproto

HERE = Path(__file__).resolve().parent
URING_HEADS_SRC = HERE / "c" / "uring_heads.c"
ENGINES = ("io_uring", "fadvise", "pread")
DAEMON_PREFIX = "kvprefetchd-"
TOOL_METHODS = ("vmtouch", "fio", "uring_heads")
POOL_METHODS = ("pypool-16", "pypool-32")
BASELINE = "none"
POOL_QUEUE = 256  # the seed's Go plugin design: a bounded queue of 256 in front of 16 workers
FIO_LINE_CHARS = 3900  # fio refuses an option value over 4096 chars (parse.c OPT_LEN_MAX)
FIO_OPEN_FILES = 1024  # as the daemon's max_open_files and uring_heads -o; NOFILE is 20000 here


def daemon_method(engine: str, workers: int, primary: int) -> str:
    """kvprefetchd-<engine> with the primary worker count, kvprefetchd-<engine>-<n>w else."""
    return DAEMON_PREFIX + engine + ("" if workers == primary else f"-{workers}w")


def all_methods(engines: Sequence[str], workers: Sequence[int] = (2,)) -> list[str]:
    daemons = [daemon_method(e, w, workers[0]) for w in workers for e in engines]
    return daemons + list(TOOL_METHODS) + list(POOL_METHODS) + [BASELINE]


# ---- measuring helpers ------------------------------------------------------------------


def disk_stat_path(path: str) -> Path | None:
    """/sys/dev/block/MAJ:MIN/stat of the device holding path (field 3: sectors read)."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def disk_read_bytes(stat: Path | None) -> int:
    if stat is None:
        return 0
    return int(stat.read_text().split()[2]) * 512  # sectors are always 512 bytes here


def drop_count() -> int:
    """How many times anyone wrote to drop_caches since boot (/proc/vmstat drop_pagecache).

    A drop by someone else during a measurement evicts what a method just warmed and
    makes the next page allocations pay host faults: such a run is void.
    """
    with open("/proc/vmstat") as handle:
        for line in handle:
            if line.startswith("drop_pagecache "):
                return int(line.split()[1])
    return 0


def wait_quiet(stat: Path | None, max_wait: float, expected_drops: int, *,
               window: float = 0.5, rate: float = 20e6, calm: float = 3.0) -> tuple[float, bool]:
    """Wait until the disk is idle (< rate bytes/s over window) and nobody dropped caches
    for `calm` s (this VM returns freed pages to the host 2-3 s after a drop).

    The machine is shared: other benchmarks may read the same disk in bursts. Returns
    (seconds waited, quiet reached); after max_wait it gives up and says so.
    expected_drops: the drop count after our own drop, whose settle is already over; a
    higher count means someone else dropped meanwhile, and calm starts from now.
    """
    started = time.monotonic()
    drops = drop_count()
    last_change = started if drops != expected_drops else started - calm
    while True:
        before = disk_read_bytes(stat)
        time.sleep(window)
        now = time.monotonic()
        if (current := drop_count()) != drops:
            drops, last_change = current, now
        idle = (disk_read_bytes(stat) - before) / window < rate
        if idle and now - last_change >= calm:
            return now - started, True
        if now - started >= max_wait:
            return now - started, False


def busy_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine (all CPUs): everything but idle and iowait."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0))


def own_cpu(env: Env) -> float:
    """CPU seconds of this process, its finished children and the daemons we started."""
    me = psutil.Process().cpu_times()
    total = me.user + me.system + children_cpu()
    for daemon in env.daemons.values():
        workers, supervisor = daemon.cpu()
        total += workers + supervisor
    return float(total)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def consume(paths: Sequence[str], head: int) -> tuple[float, int]:
    """The reader: one thread, open + pread [0, head) + close per file, no hints. Timed."""
    buf = bytearray(head)
    view = memoryview(buf)
    total = 0
    started = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            offset = 0
            while offset < head:
                n = os.preadv(fd, [view[offset:]], offset)
                if n <= 0:
                    break
                offset += n
            total += offset
        finally:
            os.close(fd)
    return time.perf_counter() - started, total


def residency_profile(paths: Sequence[str], head: int) -> dict[str, Any]:
    """Per-file means of whole-file and head residency (cachestat, so reads in flight count)."""
    started = time.perf_counter()
    whole = in_head = size = 0
    for path in paths:
        resident, file_size = cold.resident_bytes(path)
        whole += resident
        size += file_size
        in_head += cold.resident_bytes(path, 0, head)[0]
    count = max(1, len(paths))
    return {
        "sampled_files": len(paths),
        "whole_file_bytes_per_file": whole / count,
        "head_bytes_per_file": in_head / count,
        "file_bytes_per_file": size / count,
        "seconds": round(time.perf_counter() - started, 4),
    }


# ---- the daemons --------------------------------------------------------------------------


@dataclass
class Daemon:
    engine: str
    workers: int
    socket: str
    process: subprocess.Popen[bytes]
    log: Path
    worker_pids: list[int] = field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        with kvproto.RawClient(self.socket, timeout=30) as raw:
            stats: dict[str, Any] = raw.call("stats")["stats"]
            return stats

    def cpu(self) -> tuple[float, float]:
        """(workers, supervisor) CPU seconds so far, every thread included."""
        def of(pid: int) -> float:
            t = psutil.Process(pid).cpu_times()
            return float(t.user + t.system)
        return sum(of(pid) for pid in self.worker_pids), of(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_daemon(engine: str, root: Path, head: int, files: int, workers: int,
                 workdir: Path, logdir: Path, *, dedup: bool = True) -> Daemon:
    """One daemon for one engine, configured so a whole set fits in its queues.

    queue_limit is per worker and 8192 by default: a burst of 20,000 files over two
    workers would drop ~1,800 files, which measures the queue, not the warm-up.
    dedup=False turns the worker's memory of recently warmed files off, so a request
    for resident files pays the real residency check every time (the warm state).
    """
    name = f"{engine}-{workers}w"
    sock = workdir / f"kvp-{name}.sock"
    config = workdir / f"kvp-{name}.toml"
    config.write_text("\n".join([
        f'socket = "{sock}"',
        f'roots = ["{root}"]',
        f"workers = {workers}",
        f'engine = "{engine}"',
        f"read_bytes = {head}",
        f"max_read_bytes = {max(head, 64 << 20)}",
        f"queue_limit = {max(8192, files + 1024)}",
        f"max_paths_per_request = {max(100_000, files)}",
        *([] if dedup else ["dedup_ttl_ms = 0"]),
        'log_level = "warning"',
    ]) + "\n")
    log = logdir / f"daemon-{name}.log"
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvprefetchd", "--config", str(config)],
            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    daemon = Daemon(engine, workers, str(sock), process, log)
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"kvprefetchd --engine {engine} exited: {log.read_text()[-2000:]}")
        try:
            with kvproto.RawClient(str(sock), timeout=5) as raw:
                ping = raw.call("ping")
            break
        except OSError:
            if time.monotonic() > deadline:
                daemon.stop()
                raise RuntimeError(f"kvprefetchd --engine {engine} did not answer in 30 s") \
                    from None
            time.sleep(0.05)
    if ping.get("engine") != engine:
        daemon.stop()
        raise RuntimeError(f"asked for engine {engine}, daemon runs {ping.get('engine')}")
    daemon.worker_pids = [int(w["pid"]) for w in daemon.stats()["workers"]]
    return daemon


def make_prefetcher(kind: str) -> tuple[str, Callable[[str, Sequence[str], int, int],
                                                      list[dict[str, Any]]]]:
    """The client that sends the warm-up: the `kvprefetch` package, else the raw speaker."""
    if kind in ("auto", "kvprefetch"):
        try:
            from kvprefetch import Client

            def with_client(sock: str, paths: Sequence[str], head: int,
                            chunk: int) -> list[dict[str, Any]]:
                step = chunk or max(1, len(paths))
                batches = [paths[i : i + step] for i in range(0, len(paths), step)]
                with Client(sock, timeout=None) as client:
                    results = client.prefetch_many(batches, wait=True, read_bytes=head)
                return [{"accepted": r.accepted, "dropped": r.dropped, "rejected": r.rejected,
                         "outcomes": r.outcomes or {}, "elapsed_us": r.elapsed_us or 0}
                        for r in results]

            return "kvprefetch", with_client
        except ImportError:
            if kind == "kvprefetch":
                raise

    def with_raw(sock: str, paths: Sequence[str], head: int,
                 chunk: int) -> list[dict[str, Any]]:
        with kvproto.RawClient(sock, timeout=None) as raw:
            return raw.prefetch_wait(paths, head, chunk)

    return "raw", with_raw


# ---- the methods --------------------------------------------------------------------------


@dataclass
class Env:
    """Everything a method needs, fixed for the whole run."""

    paths: list[str]
    head: int
    workdir: Path
    list_file: Path
    fio_job: Path | None
    uring_heads: Path | None
    daemons: dict[str, Daemon]
    prefetch: Callable[[str, Sequence[str], int, int], list[dict[str, Any]]]
    chunk_paths: int
    state: str = "cold"


def run_tool(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, stdout) of one tool run."""
    cpu0 = children_cpu()
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr[-1000:]}")
    return wall, children_cpu() - cpu0, done.stdout


def warm_daemon(env: Env, method: str) -> dict[str, Any]:
    daemon = env.daemons[method]
    stats0 = daemon.stats()
    workers0, super0 = daemon.cpu()
    started = time.perf_counter()
    replies = env.prefetch(daemon.socket, env.paths, env.head, env.chunk_paths)
    wall = time.perf_counter() - started
    workers1, super1 = daemon.cpu()
    stats1 = daemon.stats()
    outcomes: dict[str, int] = {}
    for reply in replies:
        for name, count in reply.get("outcomes", {}).items():
            outcomes[name] = outcomes.get(name, 0) + count
    dropped = sum(r["dropped"] for r in replies)
    rejected = sum(r["rejected"] for r in replies)
    return {
        "seconds": wall,
        "cpu_s": (workers1 - workers0) + (super1 - super0),
        "detail": {
            "workers_cpu_s": round(workers1 - workers0, 4),
            "supervisor_cpu_s": round(super1 - super0, 4),
            "requests": len(replies),
            "daemon_elapsed_s_max": max(r.get("elapsed_us", 0) for r in replies) / 1e6,
            "outcomes": outcomes,
            "dropped": dropped,
            "rejected": rejected,
            "bytes_read": stats1["bytes_read"] - stats0["bytes_read"],
        },
        "ok": dropped == 0 and rejected == 0 and settled_as_expected(env, outcomes),
    }


# The host's reclaimer may take a few verified-resident heads between the warm state's
# check and the request (pages read once can go within seconds here): the daemon then
# rightly reads them again. Up to this share of such re-reads still makes a clean run.
WARM_REREAD_TOLERANCE = 0.03


def settled_as_expected(env: Env, outcomes: dict[str, int]) -> bool:
    """Cold: every head read. Warm: every head found resident and skipped, but for the
    few the reclaimer took meanwhile, which are read."""
    files = len(env.paths)
    if env.state == "cold":
        return outcomes.get("read", 0) == files
    resident, read = outcomes.get("resident", 0), outcomes.get("read", 0)
    return resident + read == files and read <= WARM_REREAD_TOLERANCE * files


def warm_vmtouch(env: Env) -> dict[str, Any]:
    wall, cpu, _ = run_tool(["vmtouch", "-t", "-q", "-p", f"0-{env.head}", "-b",
                             str(env.list_file)])
    return {"seconds": wall, "cpu_s": cpu, "detail": {}, "ok": True}


def warm_fio(env: Env) -> dict[str, Any]:
    assert env.fio_job is not None
    wall, cpu, out = run_tool(["fio", "--readonly", "--output-format=json", str(env.fio_job)])
    job = json.loads(out[out.index("{"):])["jobs"][0]
    io_bytes = int(job["read"]["io_bytes"])
    return {
        "seconds": wall,
        "cpu_s": cpu,
        "detail": {"fio_runtime_s": job["job_runtime"] / 1000, "io_bytes": io_bytes,
                   "clat_mean_us": round(job["read"]["clat_ns"]["mean"] / 1e3, 1)},
        "ok": io_bytes == len(env.paths) * env.head,
    }


def warm_uring_heads(env: Env) -> dict[str, Any]:
    assert env.uring_heads is not None
    wall, cpu, out = run_tool([str(env.uring_heads), "-f", str(env.list_file), "-m", "read",
                               "-b", str(env.head), "-q", "128", "-R"])
    report = json.loads(out.strip().splitlines()[-1])
    return {"seconds": wall, "cpu_s": cpu, "detail": report,
            "ok": report.get("bytes") == len(env.paths) * env.head}


def warm_pool(env: Env, threads: int) -> dict[str, Any]:
    """open + FADV_RANDOM + pread [0, head) + close, `threads` threads behind a queue of 256."""
    jobs: queue.Queue[str | None] = queue.Queue(maxsize=POOL_QUEUE)
    done = [0] * threads
    chunk = min(env.head, 1 << 20)

    def worker(slot: int) -> None:
        view = memoryview(bytearray(chunk))
        while (path := jobs.get()) is not None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # FADV_RANDOM: read exactly the head, not a readahead window (mm/readahead.c)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                offset = 0
                while offset < env.head:
                    n = os.preadv(fd, [view[: min(chunk, env.head - offset)]], offset)
                    if n <= 0:
                        break
                    offset += n
                done[slot] += offset
            finally:
                os.close(fd)

    cpu0 = time.process_time()
    started = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    for path in env.paths:
        jobs.put(path)
    for _ in pool:
        jobs.put(None)
    for thread in pool:
        thread.join()
    wall = time.perf_counter() - started
    return {"seconds": wall, "cpu_s": time.process_time() - cpu0,
            "detail": {"bytes": sum(done)}, "ok": sum(done) == len(env.paths) * env.head}


def warm(env: Env, method: str) -> dict[str, Any]:
    if method.startswith(DAEMON_PREFIX):
        return warm_daemon(env, method)
    if method == "vmtouch":
        return warm_vmtouch(env)
    if method == "fio":
        return warm_fio(env)
    if method == "uring_heads":
        return warm_uring_heads(env)
    if method.startswith("pypool-"):
        return warm_pool(env, int(method.split("-")[1]))
    raise ValueError(method)


# ---- preparing the tools ------------------------------------------------------------------


def fio_jobfile(paths: Sequence[str], head: int, directory: Path, out: Path) -> Path:
    """One job reading [0, head) of every file.

    fio caps an option value at 4096 chars, so the ':'-separated list is split over
    several `filename=` lines in the same section: each line adds its files to the
    job (options.c str_filename_cb appends once the job has files). Names are given
    relative to `directory=` to fit more per line; a ':' in a name is escaped '\\:'.
    filesize=head makes fio treat each file as head bytes long: it reads exactly the
    head, from offset 0, once.
    """
    lines: list[str] = []
    current: list[str] = []
    length = 0
    for path in paths:
        name = os.path.relpath(path, directory).replace(":", "\\:")
        if current and length + len(name) + 1 > FIO_LINE_CHARS:
            lines.append("filename=" + ":".join(current))
            current, length = [], 0
        current.append(name)
        length += len(name) + 1
    if current:
        lines.append("filename=" + ":".join(current))
    out.write_text("\n".join([
        "[global]",
        "ioengine=io_uring",
        "iodepth=128",
        f"bs={min(head, 1 << 20)}",
        "rw=read",
        f"filesize={head}",
        "direct=0",
        "invalidate=0",
        "fadvise_hint=random",
        "thread=1",
        "allow_file_create=0",
        f"openfiles={FIO_OPEN_FILES}",
        f"directory={directory}",
        "[heads]",
        *lines,
    ]) + "\n")
    return out


def build_uring_heads(workdir: Path) -> Path:
    out = workdir / "uring_heads"
    subprocess.run(["gcc", "-O2", "-o", str(out), str(URING_HEADS_SRC), "-luring", "-lpthread"],
                   check=True, capture_output=True, text=True)
    return out


def availability(method: str) -> str | None:
    """None when a method can run here, else the reason it is skipped."""
    if method == "vmtouch" and not shutil.which("vmtouch"):
        return "vmtouch not found on PATH"
    if method == "fio" and not shutil.which("fio"):
        return "fio not found on PATH"
    if method == "uring_heads":
        if not URING_HEADS_SRC.exists():
            return f"{URING_HEADS_SRC.relative_to(HERE.parent)} not present"
        if not shutil.which("gcc"):
            return "gcc not found on PATH"
    return None


# ---- the run ------------------------------------------------------------------------------


SLACK_BYTES = 32 << 20  # metadata (directory and inode blocks) and stray reads


def measure(env: Env, method: str, args: argparse.Namespace, stat: Path | None,
            sample: Sequence[str], rep: int) -> dict[str, Any]:
    """One cold -> warm-up -> residency -> consumer sequence, with what may have disturbed it.

    `interference` lists reasons to distrust the run: a drop_caches by someone else
    between the warm-up's start and the consumer's end, or the disk reading far more
    than this method's own pages account for (another process reading).
    """
    files = len(env.paths)
    own = drop_count()
    if env.state == "cold":
        report = cold.make_cold(env.paths, args.cold, args.settle, 64, args.seed + rep)
        own += report.method.startswith("drop")
        prepared, prepared_report = report.cold, report.as_dict()
    else:
        prepared_report = make_resident(env.paths, env.head, sample)
        prepared = prepared_report["resident"]
    waited, quiet = wait_quiet(stat, args.quiet_wait, own) if args.quiet_wait > 0 \
        else (0.0, True)
    drops0 = drop_count()
    disk0, busy0, own0 = disk_read_bytes(stat), busy_cpu_seconds(), own_cpu(env)
    if method == BASELINE:
        result: dict[str, Any] = {"seconds": None, "cpu_s": None, "detail": {}, "ok": True}
    else:
        result = warm(env, method)
    disk1, busy1, own1 = disk_read_bytes(stat), busy_cpu_seconds(), own_cpu(env)
    resident = residency_profile(sample, env.head) if method != BASELINE else None
    consumer_s, consumed = consume(env.paths, env.head)
    disk2 = disk_read_bytes(stat)
    if resident is None:
        resident = residency_profile(sample, env.head)
    drops = drop_count() - drops0
    interference = []
    if drops:
        interference.append(f"{drops} drop_caches by someone else")
    brought = resident["whole_file_bytes_per_file"] * files
    if method != BASELINE and disk1 - disk0 > 1.5 * brought + SLACK_BYTES * (1 + files // 10000):
        interference.append(f"disk read {(disk1 - disk0) / 1e6:.0f} MB during the warm-up, "
                            f"{brought / 1e6:.0f} MB of it cached")
    missing = (env.head - resident["head_bytes_per_file"]) * files if method != BASELINE \
        else brought
    if disk2 - disk1 > 1.5 * missing + SLACK_BYTES * (1 + files // 10000):
        interference.append(f"disk read {(disk2 - disk1) / 1e6:.0f} MB during the consumer "
                            f"read, {missing / 1e6:.0f} MB expected")
    if not quiet:
        interference.append(f"the disk or drop_caches never went quiet in {waited:.0f} s")
    return {
        "rep": rep,
        "state": env.state,
        # the set was verified cold (or, in the warm state, resident) before the method
        "cold": prepared if env.state == "cold" else False,
        "prepared": prepared,
        "cold_report": prepared_report,
        "waited_for_quiet_s": round(waited, 2),
        "warm_s": result["seconds"],
        "consumer_s": consumer_s,
        "total_s": (result["seconds"] or 0.0) + consumer_s,
        "cpu_s": result["cpu_s"],
        "machine_busy_cpu_s": round(busy1 - busy0, 3),
        # CPU others used meanwhile (pytest runs, other benchmarks): not retried, but shown
        "foreign_cpu_s": round(max(0.0, (busy1 - busy0) - (own1 - own0)), 3),
        "disk_read_bytes": disk1 - disk0,
        "consumer_disk_read_bytes": disk2 - disk1,
        "resident": resident,
        "interference": interference,
        "ok": bool(result["ok"]) and prepared and consumed == files * env.head,
        "detail": result["detail"],
    }


def make_resident(paths: Sequence[str], head: int, sample: Sequence[str]) -> dict[str, Any]:
    """The warm state: read every head (the consumer's read), then verify on the sample.

    Read pages stay about a minute on this VM before the host's reclaimer takes them;
    a run follows within seconds, and a head found short is read again once.
    """
    started = time.monotonic()
    consume(paths, head)
    profile = residency_profile(sample, head)
    if profile["head_bytes_per_file"] < head:
        consume(sample, head)
        profile = residency_profile(sample, head)
    return {"method": "read", "seconds": round(time.monotonic() - started, 3),
            "sampled_files": profile["sampled_files"],
            "head_bytes_per_file": profile["head_bytes_per_file"],
            "resident": profile["head_bytes_per_file"] >= 0.99 * head}


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def paired_ratio(mine: Sequence[float | None], ref: Sequence[float | None]) -> float | None:
    """Median over repetitions of mine/ref measured in the same repetition."""
    ratios = [a / b for a, b in zip(mine, ref, strict=True) if a is not None and b]
    return statistics.median(ratios) if ratios else None


def summarize(methods: list[str], runs: dict[str, list[dict[str, Any]]], files: int,
              head: int, skipped: dict[str, str]) -> dict[str, Any]:
    asked = files * head
    warm_of = {m: [r["warm_s"] for r in runs[m]] for m in methods}
    total_of = {m: [r["total_s"] for r in runs[m]] for m in methods}
    fio_runtime = [r["detail"].get("fio_runtime_s") for r in runs.get("fio", [])]
    out: dict[str, Any] = {}
    for method in methods:
        if method in skipped:
            out[method] = {"status": f"skipped: {skipped[method]}"}
            continue
        rs = runs[method]
        warm_s = warm_of[method]
        med = median([w for w in warm_s if w is not None])
        consumer = [r["consumer_s"] for r in rs]
        cpu = [r["cpu_s"] for r in rs if r["cpu_s"] is not None]
        whole = [r["resident"]["whole_file_bytes_per_file"] for r in rs]
        in_head = [r["resident"]["head_bytes_per_file"] for r in rs]
        entry: dict[str, Any] = {
            "status": "ok" if all(r["ok"] for r in rs) else "suspect: see runs[].ok",
            "kind": ("daemon" if method.startswith(DAEMON_PREFIX) else "baseline"
                     if method == BASELINE else "python" if method in POOL_METHODS else "tool"),
            "files": files,
            "bytes": asked,
            "median_s": med,
            "reps_s": warm_s,
            "gb_s": asked / 1e9 / med if med else None,
            "files_s": files / med if med else None,
            "ratio_to_fio": None if method == BASELINE or "fio" in skipped
            else paired_ratio(warm_s, warm_of["fio"]),
            "ratio_to_vmtouch": None if method == BASELINE or "vmtouch" in skipped
            else paired_ratio(warm_s, warm_of["vmtouch"]),
            # fio's own job_runtime leaves out its start-up (parsing, setting up every file)
            "ratio_to_fio_runtime": None if method == BASELINE or "fio" in skipped
            else paired_ratio(warm_s, fio_runtime),
            "consumer": {"median_s": median(consumer), "reps_s": consumer},
            "total": {
                "median_s": median(total_of[method]),
                "reps_s": total_of[method],
                "ratio_to_fio": None if "fio" in skipped
                else paired_ratio(total_of[method], total_of["fio"]),
                "ratio_to_vmtouch": None if "vmtouch" in skipped
                else paired_ratio(total_of[method], total_of["vmtouch"]),
                "ratio_to_none": paired_ratio(total_of[method], total_of[BASELINE])
                if BASELINE in runs and BASELINE not in skipped else None,
            },
            "resident": {
                "asked_per_file": head,
                "whole_file_bytes_per_file": median(whole),
                "head_bytes_per_file": median(in_head),
                "brought_over_asked": (median(whole) or 0) / head,
                "measured": "after the consumer read" if method == BASELINE
                else "after the warm-up, before the consumer read",
            },
            "disk_read_bytes_per_file": median(
                [(r["consumer_disk_read_bytes"] if method == BASELINE else r["disk_read_bytes"])
                 / files for r in rs]),
            "disturbed_runs_kept": sum(1 for r in rs if r["interference"]),
            "runs_redone": sum(len(r["discarded"]) for r in rs),
            "foreign_cpu_s_median": median([r["foreign_cpu_s"] for r in rs]),
            "cpu": {
                "median_s": median(cpu),
                "reps_s": cpu,
                "s_per_gb": (median(cpu) or 0) / (asked / 1e9) if cpu else None,
                "what": {"daemon": "workers + supervisor (psutil)", "tool": "child rusage",
                         "python": "this process (all threads)", "baseline": "-"}[
                    "daemon" if method.startswith(DAEMON_PREFIX) else "baseline"
                    if method == BASELINE else "python" if method in POOL_METHODS else "tool"],
            },
            "runs": rs,
        }
        out[method] = entry
    return out


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> str:
    head = ("method", "warm s", "GB/s", "files/s", "x fio", "x fio-rt", "x vmt", "consumer s",
            "sum s",
            "sum x none", "cached/file", "head warm", "CPU s/GB", "disturbed/redone")
    rows = [head]
    for method, r in results["methods"].items():
        if not r["status"].startswith(("ok", "suspect")):
            rows.append((method, r["status"], *[""] * (len(head) - 2)))
            continue
        res = r["resident"]
        rows.append((
            method + ("" if r["status"] == "ok" else " (!)"),
            fmt(r["median_s"], ".3f"), fmt(r["gb_s"], ".2f"), fmt(r["files_s"], ".0f"),
            fmt(r["ratio_to_fio"], ".2f"), fmt(r["ratio_to_fio_runtime"], ".2f"),
            fmt(r["ratio_to_vmtouch"], ".2f"),
            fmt(r["consumer"]["median_s"], ".3f"), fmt(r["total"]["median_s"], ".3f"),
            fmt(r["total"]["ratio_to_none"], ".2f"),
            f"{res['whole_file_bytes_per_file'] / (1 << 20):.2f} MiB",
            f"{100 * res['head_bytes_per_file'] / res['asked_per_file']:.0f}%",
            fmt(r["cpu"]["s_per_gb"], ".2f"),
            f"{r['disturbed_runs_kept']}/{r['runs_redone']}",
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                     for row in rows)


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
    methods = all_methods(engines, worker_counts)
    if args.methods != "all":
        wanted = [m for m in args.methods.split(",") if m]
        unknown = set(wanted) - set(methods)
        if unknown:
            raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {methods}")
        methods = [m for m in methods if m in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    skipped = {m: why for m in methods if (why := availability(m)) is not None}
    active = [m for m in methods if m not in skipped]
    client_kind, prefetch = make_prefetcher(args.client)
    sample = cold.sample(paths, args.residency_sample, args.seed)
    stat = disk_stat_path(paths[0])
    say = (lambda _text: None) if args.quiet else (lambda text: print(text, file=sys.stderr))

    workdir = Path(tempfile.mkdtemp(prefix="kvbench-"))
    daemons: dict[str, Daemon] = {}
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
            uring_heads=uring_heads,
            daemons=daemons, prefetch=prefetch, chunk_paths=args.chunk_paths,
            state=args.state)
        for engine in engines:
            for workers in worker_counts:
                method = daemon_method(engine, workers, worker_counts[0])
                if method in active:
                    daemons[method] = start_daemon(engine, ds.root, head, len(paths), workers,
                                                   workdir, args.out,
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
        "benchmark": "warmup",
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
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
