"""The methods that are not kvprefetchd: vmtouch, fio, uring_heads and Python thread pools.

How each is run, and why so (module docstring of warmup.py): each reads exactly
[0, head) of every file of the set, and reports its wall time, its CPU time and
whether it read every byte it was asked for.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import children_cpu

HERE = Path(__file__).resolve().parent
URING_HEADS_SRC = HERE / "c" / "uring_heads.c"
TOOL_METHODS = ("vmtouch", "fio", "fio-direct", "uring_heads")
# The device's own ceiling, not a warmer: O_DIRECT reads of the same heads, 256 in flight (the
# device queue), so no page cache and no readahead. No warmer beats what the disk serves: its
# ratio to fio says how far any "x fio" target can go on this machine.
DEVICE_REFERENCE = "fio-direct"
DIRECT_DEPTH = 256
POOL_METHODS = ("pypool-16", "pypool-32")  # the local-disk suite's; any pypool-N runs
POOL_PREFIX = "pypool-"
POOL_QUEUE = 256  # the seed's Go plugin design: a bounded queue of 256 in front of 16 workers
POOL_STACK = 256 << 10  # per pool thread: 1,024 threads of 256 KiB, not of the default 8 MiB
FIO_LINE_CHARS = 3900  # fio refuses an option value over 4096 chars (parse.c OPT_LEN_MAX)
FIO_OPEN_FILES = 1024  # as the daemon's max_open_files and uring_heads -o; NOFILE is 20000 here


def run_tool(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, stdout) of one tool run."""
    cpu0 = children_cpu()
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr[-1000:]}")
    return wall, children_cpu() - cpu0, done.stdout


def pool_threads(method: str) -> int | None:
    """The thread count of a pool method (pypool-N), None for any other method."""
    count = method.removeprefix(POOL_PREFIX)
    return int(count) if method.startswith(POOL_PREFIX) and count.isdigit() else None


def warm_vmtouch(list_file: Path, head: int | None) -> dict[str, Any]:
    """vmtouch -t of [0, head) of every file, or of whole files when head is None."""
    span = ["-p", f"0-{head}"] if head is not None else []
    wall, cpu, _ = run_tool(["vmtouch", "-t", "-q", *span, "-b", str(list_file)])
    return {"seconds": wall, "cpu_s": cpu, "detail": {}, "ok": True}


def warm_fio(job: Path, files: int, head: int) -> dict[str, Any]:
    wall, cpu, out = run_tool(["fio", "--readonly", "--output-format=json", str(job)])
    job = json.loads(out[out.index("{"):])["jobs"][0]
    io_bytes = int(job["read"]["io_bytes"])
    return {
        "seconds": wall,
        "cpu_s": cpu,
        "detail": {"fio_runtime_s": job["job_runtime"] / 1000, "io_bytes": io_bytes,
                   "clat_mean_us": round(job["read"]["clat_ns"]["mean"] / 1e3, 1)},
        "ok": io_bytes == files * head,
    }


def warm_uring_heads(binary: Path, list_file: Path, files: int, head: int,
                     depth: int = 128) -> dict[str, Any]:
    wall, cpu, out = run_tool([str(binary), "-f", str(list_file), "-m", "read",
                               "-b", str(head), "-q", str(depth), "-R"])
    report = json.loads(out.strip().splitlines()[-1])
    return {"seconds": wall, "cpu_s": cpu, "detail": report,
            "ok": report.get("bytes") == files * head}


def warm_pool(paths: Sequence[str], head: int, threads: int) -> dict[str, Any]:
    """open + FADV_RANDOM + pread [0, head) + close, `threads` threads behind a queue of 256.

    Real OS threads: CPython releases the GIL around os.open, os.posix_fadvise, os.preadv
    and os.close (Modules/posixmodule.c, Py_BEGIN_ALLOW_THREADS), so 1,024 of them keep
    1,024 reads in flight while the interpreter runs whichever thread has work. The pool
    is standing when the clock starts, as the daemon's threads are: starting 1,024 threads
    takes longer than a warm-up of 200 files on a fast tier.
    """
    jobs: queue.Queue[str | None] = queue.Queue(maxsize=POOL_QUEUE)
    done = [0] * threads
    chunk = min(head, 1 << 20)
    # Written once here, so the clock does not count first-touch faults of 1,024 buffers
    # (a standing pool's buffers are as warm as the daemon's).
    views = [memoryview(bytearray(b"\1" * chunk)) for _ in range(threads)]

    def warm_one(path: str, slot: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return  # counted short: its head's bytes never add up
        try:
            # FADV_RANDOM: read exactly the head, not a readahead window (mm/readahead.c)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            offset = 0
            while offset < head:
                n = os.preadv(fd, [views[slot][: min(chunk, head - offset)]], offset)
                if n <= 0:
                    break
                offset += n
            done[slot] += offset
        except OSError:
            pass  # an EIO from a failing tier: short, as above; the pool carries on
        finally:
            os.close(fd)

    def worker(slot: int) -> None:
        while (path := jobs.get()) is not None:
            try:
                warm_one(path, slot)
            finally:
                jobs.task_done()

    previous = threading.stack_size(POOL_STACK)
    try:
        pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        for thread in pool:
            thread.start()  # returns once the thread runs: it now waits on the queue
    finally:
        threading.stack_size(previous)
    cpu0 = time.process_time()
    started = time.perf_counter()
    for path in paths:
        jobs.put(path)
    jobs.join()  # every head read: the warm-up is over (stopping the pool is not part of it)
    wall = time.perf_counter() - started
    for _ in pool:
        jobs.put(None)
    for thread in pool:
        thread.join()
    return {"seconds": wall, "cpu_s": time.process_time() - cpu0,
            "detail": {"bytes": sum(done), "threads": threads},
            "ok": sum(done) == len(paths) * head}


def fio_jobfile(paths: Sequence[str], head: int, directory: Path, out: Path,
                iodepth: int = 128, direct: bool = False) -> Path:
    """One job reading [0, head) of every file, `iodepth` reads in flight.

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
        f"iodepth={iodepth}",
        f"bs={min(head, 1 << 20)}",
        "rw=read",
        f"filesize={head}",
        f"direct={int(direct)}",
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
    if method in ("fio", DEVICE_REFERENCE) and not shutil.which("fio"):
        return "fio not found on PATH"
    if method == "uring_heads":
        if not URING_HEADS_SRC.exists():
            return f"{URING_HEADS_SRC.relative_to(HERE.parent)} not present"
        if not shutil.which("gcc"):
            return "gcc not found on PATH"
    return None
