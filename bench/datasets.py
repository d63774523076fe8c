"""Benchmark datasets: N files of one size, laid out as the fs connector writes them.

Why this shape: the daemon's cost per file is dominated by path resolution and
opens as much as by bytes, so the files sit where vLLM's fs connector puts them
(spec/kv-file-layout.md §5.1: `<root>/<safe_model>_<fp12>_r0/<h[0:3]>/<h[3:5]>_g0/<h>.bin`,
one directory pair per file in practice), with names derived from a seed so a run
can be repeated on the same files.

Data is real (not sparse: a hole reads as zeros without touching the disk, which
would flatter every method) and varied (every 1 MiB chunk starts with its own
file/offset stamp, so no two chunks are identical to a deduplicating backend), but
cheap to write: the random bytes come from a small pool generated once from the seed.

    .venv/bin/python bench/datasets.py 2000x4MiB 20000x256KiB     # create, print roots
    .venv/bin/python bench/datasets.py --list 200x4MiB | head      # print the paths
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BASE = Path("/var/tmp/kvbench")  # not /tmp: often a small tmpfs, where nothing is cold
DEFAULT_SEED = 1
MODEL = "Qwen/Qwen3-8B"  # vLLM --model as given; "/" becomes "_" on disk (spec §5.1)
POOL_BLOCKS = 8
BLOCK = 1 << 20
STAMP = 32  # bytes at the start of every chunk that make it unique
MANIFEST = "manifest.json"

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'4MiB', '256KiB', '1M', '4096' -> bytes (binary units: what file systems use)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 4MiB, 256KiB, 1M)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


@dataclass(frozen=True)
class Dataset:
    """A generated set: `count` files of `size` bytes under `root`, named from `seed`."""

    count: int
    size: int
    seed: int
    root: Path

    @property
    def name(self) -> str:
        return f"{self.count}x{format_size(self.size)}"

    @property
    def model_dir(self) -> Path:
        fingerprint = hashlib.sha256(f"kvbench:{self.seed}:{self.name}".encode()).hexdigest()[:12]
        return self.root / f"{MODEL.replace('/', '_')}_{fingerprint}_r0"

    def paths(self) -> list[str]:
        """Every file, in generation order (a stable order the benchmarks can rely on)."""
        out = []
        base = self.model_dir
        for index in range(self.count):
            h = hashlib.sha256(f"kvbench:{self.seed}:{self.name}:{index}".encode()).hexdigest()
            out.append(str(base / h[0:3] / f"{h[3:5]}_g0" / f"{h}.bin"))
        return out

    @property
    def total_bytes(self) -> int:
        return self.count * self.size


def dataset(spec: str, seed: int = DEFAULT_SEED, base: Path = DEFAULT_BASE) -> Dataset:
    """Parse 'COUNTxSIZE' (e.g. '2000x4MiB') into a Dataset rooted under base."""
    match = re.fullmatch(r"(\d+)x(.+)", spec.strip())
    if not match:
        raise ValueError(f"dataset spec {spec!r} is not COUNTxSIZE, e.g. 2000x4MiB")
    count, size = int(match.group(1)), parse_size(match.group(2))
    if count < 1 or size < 1:
        raise ValueError(f"dataset spec {spec!r}: count and size must be positive")
    name = f"{count}x{format_size(size)}"
    return Dataset(count, size, seed, Path(base) / f"ds-{name}-seed{seed}")


def _pool(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(BLOCK) for _ in range(POOL_BLOCKS)]


def _write_file(path: str, size: int, index: int, pool: Sequence[bytes]) -> None:
    """Write one file through a temp name and rename, as the connector does (spec §5.1)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        offset = 0
        while offset < size:
            block = pool[(index * 7 + offset // BLOCK) % len(pool)]
            length = min(BLOCK, size - offset)
            stamp = f"{index:012d}:{offset:019d}".encode()[:STAMP].ljust(STAMP, b"\0")
            chunk = (stamp + block[STAMP:length]) if length > STAMP else stamp[:length]
            view = memoryview(chunk)
            while view:
                view = view[os.pwrite(fd, view, offset + len(chunk) - len(view)):]
            offset += length
    finally:
        os.close(fd)
    os.replace(tmp, path)


def is_complete(ds: Dataset, paths: Sequence[str] | None = None) -> bool:
    """The manifest matches and every file is there at the right size (a cheap stat pass)."""
    try:
        manifest = json.loads((ds.root / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("count") != ds.count or manifest.get("size") != ds.size \
            or manifest.get("seed") != ds.seed:
        return False
    for path in paths if paths is not None else ds.paths():
        try:
            if os.stat(path).st_size != ds.size:
                return False
        except OSError:
            return False
    return True


def ensure(ds: Dataset, *, quiet: bool = False) -> list[str]:
    """Create the dataset unless it is complete already; return its paths.

    Idempotent: an interrupted run leaves a missing manifest (written last) or a
    missing or short file, and the next call writes only what is missing.
    """
    paths = ds.paths()
    if is_complete(ds, paths):
        return paths
    started = time.monotonic()
    pool = _pool(ds.seed)
    written = 0
    for index, path in enumerate(paths):
        try:
            if os.stat(path).st_size == ds.size:
                continue
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_file(path, ds.size, index, pool)
        written += 1
        if not quiet and written % 1000 == 0:
            print(f"  {ds.name}: {written} files written", file=sys.stderr)
    os.sync()  # dirty pages cannot be dropped: the cold step needs them on disk
    (ds.root / MANIFEST).write_text(json.dumps(
        {"count": ds.count, "size": ds.size, "seed": ds.seed, "model": MODEL,
         "layout": "<root>/<safe_model>_<fp12>_r0/<h[0:3]>/<h[3:5]>_g0/<h>.bin"},
        indent=1) + "\n")
    if not quiet:
        print(f"  {ds.name}: wrote {written} files ({written * ds.size / 1e9:.2f} GB) in "
              f"{time.monotonic() - started:.1f} s under {ds.root}", file=sys.stderr)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", metavar="COUNTxSIZE", help="e.g. 2000x4MiB")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--base", type=Path, default=DEFAULT_BASE,
                        help=f"parent directory of the datasets (default {DEFAULT_BASE})")
    parser.add_argument("--list", action="store_true", help="print every path, not just roots")
    args = parser.parse_args(argv)
    for spec in args.specs:
        ds = dataset(spec, args.seed, args.base)
        paths = ensure(ds)
        if args.list:
            try:
                print("\n".join(paths))
            except BrokenPipeError:  # `| head`: the reader has what it wanted
                sys.stderr.close()
                return 0
        else:
            print(ds.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
