"""The simulator's own ceiling: how fast it serves at zero latency, against the backing dir.

    .venv/bin/python bench/tiersim/ceiling.py --out bench/out/tiersim-ceiling [--reps 5]

A warmer measured on the simulator must not be measuring the simulator, so this reads the
same files, by the same readers, directly from the backing directory and through the mount
at latency 0.  The backing files are warm in the page cache both times (their first read
warms them), so the backing runs are memory-speed and the difference is the FUSE path and
the simulator; the mount's own page cache is emptied (`evict_all`) before every run.
Readers, each the most aggressive of its kind here:
- fio, 4 jobs, sequential buffered 1 MiB reads of 4 large files (bandwidth);
- kvprefetchd's native pread engine (bench/c/native_heads.py), 64 threads, every
  file of a flat directory of small files whole (files per second).
Runs alternate backing/mount, medians over --reps; the simulator's CPU seconds per run come
from /proc/PID/stat, to show whether it, rather than the reader, is the limit.  Last, a check
that 1,024 fetches of 100 ms are in flight at once with the simulator's fixed threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import tiersim  # noqa: E402 - needs bench/ on sys.path first

MiB = 1 << 20


def make_files(directory: Path, count: int, size: int) -> list[Path]:
    """Files of random bytes (idempotent), read once so the backing copy is warm."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(MiB)
    paths = []
    for i in range(count):
        path = directory / f"f{i:05}"
        if not path.exists() or path.stat().st_size != size:
            with open(path, "wb") as f:
                for offset in range(0, size, MiB):
                    f.write(block[:min(MiB, size - offset)])
        paths.append(path)
    for path in paths:
        with open(path, "rb") as f:
            while f.read(8 * MiB):
                pass
    return paths


def fio_gbps(files: list[Path]) -> tuple[float, int]:
    args = ["fio", "--output-format=json", "--readonly", "--rw=read", "--bs=1M",
            "--ioengine=psync", "--group_reporting"]
    for i, path in enumerate(files):
        args += [f"--name=j{i}", f"--filename={path}"]
    out = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
    read = out["jobs"][0]["read"]
    return read["io_bytes"] / (read["runtime"] / 1e3) / 1e9, int(read["io_bytes"])


def native_files_per_s(files: list[Path], size: int, threads: int) -> tuple[float, int]:
    with tempfile.NamedTemporaryFile("w", suffix=".list") as listing:
        listing.write("\n".join(str(p) for p in files))
        listing.flush()
        done = subprocess.run(
            [sys.executable, str(BENCH / "c" / "native_heads.py"), "-f", listing.name,
             "-e", "pread", "-b", str(size), "-c", str(size), "-t", str(threads)],
            capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["bytes"] == len(files) * size, result
    return result["files"] / result["seconds"], int(result["bytes"])


def in_flight_check(backing: Path, mountpoint: Path, count: int) -> dict[str, Any]:
    """At 100 ms per fetch, 1,024 io_uring reads at once: the simulator must hold 1,024
    fetches in flight with its fixed threads (the kernel's max_background, raised, is the
    only cap)."""
    files = make_files(backing / "inflight", count, 512 << 10)
    with tiersim.mount(backing, mountpoint, latency_ms=100) as tier, \
            tempfile.NamedTemporaryFile("w", suffix=".list") as listing:
        listing.write("\n".join(str(tier.mountpoint / "inflight" / p.name) for p in files))
        listing.flush()
        tier.evict_all()
        done = subprocess.run(
            [sys.executable, str(BENCH / "c" / "native_heads.py"), "-f", listing.name,
             "-e", "uring_read", "-b", "256K", "-c", "256K", "-q", "1024"],
            capture_output=True, text=True, check=True)
        assert tier.process is not None
        threads = len(os.listdir(f"/proc/{tier.process.pid}/task"))
        stats = tier.stats()
    seconds = json.loads(done.stdout)["seconds"]
    return {"files": count, "latency_ms": 100, "reader": "native uring_read, depth 1024",
            "seconds": seconds, "ideal_seconds": -(-count // 1024) * 0.1,
            "peak_in_flight": stats.peak_in_flight, "fetches": stats.fetches,
            "simulator_threads": threads}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, reps: int, run: Callable[[Path], tuple[float, int]],
            backing: Path, tier: tiersim.Tier) -> dict[str, Any]:
    """Alternate backing and mount runs; medians, and the simulator's CPU per GB."""
    direct, through, cpu_per_gb = [], [], []
    for _ in range(reps):
        direct.append(run(backing)[0])
        tier.evict_all()
        assert tier.process is not None
        before = cpu_seconds(tier.process.pid)
        rate, nbytes = run(tier.mountpoint)
        cpu_per_gb.append((cpu_seconds(tier.process.pid) - before) / (nbytes / 1e9))
        through.append(rate)
    backing_rate, tiersim_rate = statistics.median(direct), statistics.median(through)
    return {"reader": name, "backing": backing_rate, "tiersim": tiersim_rate,
            "ratio": tiersim_rate / backing_rate, "backing_all": direct, "tiersim_all": through,
            "tiersim_cpu_s_per_gb": statistics.median(cpu_per_gb)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", type=Path, default=Path("/tmp/tiersim-ceiling"),
                    help="backing files go here (about 6 GB; removed after, unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the backing files for a next run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big", type=int, default=512, help="MiB per large file (4 files)")
    ap.add_argument("--small", type=int, default=8000, help="count of 256 KiB files")
    ap.add_argument("--inflight", type=int, default=4000, help="files of the in-flight check")
    ap.add_argument("--no-splice", action="store_true")
    a = ap.parse_args()
    try:
        run(a)
    finally:
        if not a.keep:
            shutil.rmtree(a.base, ignore_errors=True)


def run(a: argparse.Namespace) -> None:
    backing = a.base / "backing"
    big = make_files(backing / "big", 4, a.big * MiB)
    small_size = 256 << 10
    small = make_files(backing / "small", a.small, small_size)
    mountpoint = a.base / "mnt"
    rows = []
    with tiersim.mount(backing, mountpoint, latency_ms=0, splice=not a.no_splice) as tier:
        def seq(root: Path) -> tuple[float, int]:
            return fio_gbps([root / "big" / p.name for p in big])

        def heads(root: Path) -> tuple[float, int]:
            return native_files_per_s([root / "small" / p.name for p in small], small_size, 64)

        rows.append(measure("fio 4 jobs, 1 MiB sequential, GB/s", a.reps, seq, backing, tier))
        rows.append(measure(f"native pread 64 threads, {a.small} x 256 KiB, files/s", a.reps,
                            heads, backing, tier))
    inflight = in_flight_check(backing, mountpoint, a.inflight)
    result = {"date": time.strftime("%Y-%m-%d"), "kernel": os.uname().release,
              "cpus": os.cpu_count(), "splice": not a.no_splice, "rows": rows,
              "in_flight": inflight}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "ceiling.json").write_text(json.dumps(result, indent=2))
    for row in rows:
        print(f"{row['reader']}: backing {row['backing']:.2f}, tiersim {row['tiersim']:.2f} "
              f"({row['ratio']:.2f}x), simulator CPU {row['tiersim_cpu_s_per_gb']:.2f} s/GB")
    print(f"in flight at 100 ms: {inflight['files']} files in {inflight['seconds']:.2f} s "
          f"(ideal {inflight['ideal_seconds']:.1f} s), peak {inflight['peak_in_flight']} "
          f"fetches in flight, {inflight['simulator_threads']} simulator threads")


if __name__ == "__main__":
    main()
