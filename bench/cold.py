"""Make a set of files cold, then prove it: a benchmark of warm-up is void on a warm set.

Two ways, in order of preference:
- drop: as root, `sync; echo 3 > /proc/sys/vm/drop_caches`. Drops page cache *and*
  dentries/inodes, so the opens are cold too, as on a file system that has not seen
  the files. Then settle (default 4 s): this VM hands freed pages back to the host
  2-3 s after a drop, and a page touched while that is going on pays a host fault
  that belongs to no method (measured on this machine; see the brief in bench/README.md).
- fadvise: posix_fadvise(DONTNEED) on every file (mm/fadvise.c: invalidates clean,
  unmapped pages). Needs no root, leaves metadata warm; what tests use.

Either way the result is verified, not assumed: residency of a seeded random
sample of whole files is read back through the daemon's own native wrapper
(cachestat, or mincore before Linux 6.5), and the report says how much was left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets

from kvharness import pagecache

DEFAULT_SETTLE = 4.0
DEFAULT_SAMPLE = 256
# A set is "cold" when at most this fraction of the sampled bytes is still cached.
# Not 0: a page under writeback or mapped by someone else survives a drop.
COLD_FRACTION = 0.001


def sample(paths: Sequence[str], count: int, seed: int = 0) -> list[str]:
    """A seeded random sample (all paths when count is 0 or exceeds them)."""
    if count <= 0 or count >= len(paths):
        return list(paths)
    return random.Random(seed).sample(list(paths), count)


def residency(paths: Sequence[str]) -> dict[str, int]:
    """Whole-file residency summed over paths: {'files', 'bytes', 'resident'}."""
    total = cached = 0
    for path in paths:
        resident, size = pagecache.residency(path)
        total += size
        cached += resident
    return {"files": len(paths), "bytes": total, "resident": cached}


def drop_caches() -> None:
    """sync, then drop clean page cache, dentries and inodes.

    Documentation/admin-guide/sysctl/vm.rst, drop_caches: 3 frees both.
    """
    os.sync()  # dirty pages are not dropped: write them out first
    with open("/proc/sys/vm/drop_caches", "w") as handle:
        handle.write("3\n")


def evict(paths: Sequence[str]) -> None:
    """DONTNEED every file: the unprivileged way; dentries and inodes stay cached.

    No fdatasync per file (it may cost a disk flush each, on 20,000 files): a page
    still dirty survives DONTNEED, and make_cold's verification then says so.
    """
    for path in paths:
        pagecache.evict(path, sync=False)


def can_drop() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


@dataclass
class ColdReport:
    method: str          # "drop" or "fadvise" (what was finally used)
    metadata_cold: bool  # dentries and inodes dropped too
    seconds: float       # spent making cold, settle included
    settle: float
    sampled_files: int
    sampled_bytes: int
    resident_before: int
    resident_after: int
    cold: bool           # resident_after <= COLD_FRACTION of sampled_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_cold(paths: Sequence[str], method: str = "auto", settle: float = DEFAULT_SETTLE,
              sample_files: int = DEFAULT_SAMPLE, seed: int = 0) -> ColdReport:
    """Evict paths by `method` ('auto': drop when root, else fadvise), settle, verify.

    If a drop leaves the sample warm (a page mapped or locked by someone), a DONTNEED
    pass follows before giving up; the report's `cold` says whether it worked.
    """
    if method == "auto":
        method = "drop" if can_drop() else "fadvise"
    if method == "drop" and not can_drop():
        raise PermissionError("drop_caches needs root; use --cold fadvise")
    probe = sample(paths, sample_files, seed)
    started = time.monotonic()
    before = residency(probe)
    if method == "drop":
        drop_caches()
    else:
        evict(paths)
    if settle > 0:
        time.sleep(settle)
    after = residency(probe)
    used = method
    if method == "drop" and after["resident"] > COLD_FRACTION * after["bytes"]:
        evict(paths)
        used = "drop+fadvise"
        after = residency(probe)
    return ColdReport(
        method=used,
        metadata_cold=method == "drop",
        seconds=round(time.monotonic() - started, 3),
        settle=settle,
        sampled_files=after["files"],
        sampled_bytes=after["bytes"],
        resident_before=before["resident"],
        resident_after=after["resident"],
        cold=after["resident"] <= COLD_FRACTION * after["bytes"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="COUNTxSIZE, e.g. 2000x4MiB")
    parser.add_argument("--seed", type=int, default=datasets.DEFAULT_SEED)
    parser.add_argument("--base", type=Path, default=datasets.DEFAULT_BASE)
    parser.add_argument("--method", choices=("auto", "drop", "fadvise"), default="auto")
    parser.add_argument("--settle", type=float, default=DEFAULT_SETTLE,
                        help="seconds to wait after evicting (default %(default)s)")
    parser.add_argument("--sample", type=int, default=DEFAULT_SAMPLE,
                        help="files whose residency is checked (0: all)")
    args = parser.parse_args(argv)
    ds = datasets.dataset(args.dataset, args.seed, args.base)
    paths = datasets.ensure(ds)
    report = make_cold(paths, args.method, args.settle, args.sample, args.seed)
    print(json.dumps(report.as_dict(), indent=1))
    return 0 if report.cold else 1


if __name__ == "__main__":
    sys.exit(main())
