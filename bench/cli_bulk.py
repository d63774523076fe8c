"""`kvprefetch warm -f LIST` over lists far past the daemon's queues (issue 17's done-means).

For each list size: a set of cold files (made once under --base, page cache dropped before
each run), a daemon with its default queues (2 workers x 8,192), and the CLI run as a user
would run it, with --wait and fire-and-forget. Measured from outside: exit code, the CLI's
JSON summary (dropped, resent, outcomes), wall time, and the CLI's peak RSS (polled from
/proc every 20 ms), which must not grow with the list: the list is streamed, never held.

    bench/cli_bulk.py --sizes 20000,1000000 --out bench/out/cli-bulk
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvharness.daemon import start_config

FILE_BYTES = 4096


def make_set(base: Path, count: int) -> Path:
    """count files of FILE_BYTES under base/cli-COUNT, and their list (made once)."""
    root = base / f"cli-{count}"
    listing = base / f"cli-{count}.list"
    if listing.exists():
        return listing
    block = os.urandom(FILE_BYTES)
    with open(listing.with_suffix(".tmp"), "w") as out:
        for i in range(count):
            folder = root / f"{i % 1024:03x}"
            if i < 1024:
                folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{i:08d}.bin"
            with open(path, "wb") as handle:
                handle.write(block)
            out.write(f"{path}\n")
    os.rename(listing.with_suffix(".tmp"), listing)
    return listing


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as handle:
        handle.write("3\n")
    time.sleep(4)  # the VM returns freed pages to the host for 2-3 s: let it settle


def peak_rss_run(argv: list[str]) -> tuple[int, bytes, bytes, float, int]:
    """Run argv; its exit code, stdout, stderr, wall seconds and peak RSS bytes."""
    started = time.monotonic()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    status = f"/proc/{child.pid}/status"
    while child.poll() is None:
        try:
            with open(status) as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(0.02)
    out, err = child.communicate()
    return child.returncode, out, err, time.monotonic() - started, peak


def run_one(base: Path, count: int, wait: bool) -> dict[str, Any]:
    listing = make_set(base, count)
    root = base / f"cli-{count}"
    workdir = base / "daemon"
    workdir.mkdir(exist_ok=True)
    drop_caches()
    daemon = start_config(workdir, {"roots": [str(root)], "workers": 2, "read_bytes": FILE_BYTES})
    try:
        argv = [sys.executable, "-m", "kvprefetch", "--socket", str(daemon.socket_path),
                "--timeout", "0", "--json", "warm", "-f", str(listing)]
        if wait:
            argv.append("--wait")
        code, out, err, seconds, peak = peak_rss_run(argv)
        # Fire and forget: the CLI is done once every file is accepted; wait for the
        # daemon to settle them so its figures are whole.
        while daemon.stats()["files"]["in_flight"]:
            time.sleep(0.1)
        stats = daemon.stats()
    finally:
        daemon.stop()
    summary = json.loads(out) if out else {}
    return {
        "files": count, "wait": wait, "exit": code, "seconds": round(seconds, 2),
        "files_per_s": round(count / seconds), "cli_peak_rss_mib": round(peak / 2**20, 1),
        "dropped": summary.get("dropped"), "resent": summary.get("resent"),
        "accepted": summary.get("accepted"), "outcomes": summary.get("outcomes"),
        "daemon_dropped": stats["files"]["dropped"], "daemon_read": stats["files"]["read"],
        "stderr": err.decode(errors="replace")[-300:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="20000,1000000")
    parser.add_argument("--base", default="/var/tmp/kvbench-cli")
    parser.add_argument("--out", default="bench/out/cli-bulk")
    args = parser.parse_args()
    base = Path(args.base)
    base.mkdir(parents=True, exist_ok=True)
    results = []
    for count in (int(n) for n in args.sizes.split(",")):
        for wait in (True, False):
            result = run_one(base, count, wait)
            print(json.dumps(result), flush=True)
            results.append(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = ["| files | mode | exit | dropped | resent by the CLI | seconds | files/s | "
             "CLI peak RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['files']:,} | {'--wait' if r['wait'] else 'fire-and-forget'} | "
                     f"{r['exit']} | {r['dropped']} | {r['resent']:,} | {r['seconds']} | "
                     f"{r['files_per_s']:,} | {r['cli_peak_rss_mib']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
