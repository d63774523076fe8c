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

    .venv/bin/python bench/datasets.py 2000x4MiB 20000x256KiB mixed:3000   # create, print roots
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
# The mixed tree: (model, tensor-parallel ranks, KV groups) and the file sizes drawn.
# Sizes differ by model and block size in practice: 256 KiB (a small model, 16-token
# blocks) to 8 MiB (a large model, big blocks); ranks and groups as TP and hybrid models
# lay them out (spec/kv-file-layout.md §5.1: _r<rank>, _g<group>).
MIXED_LAYOUT = (("Qwen/Qwen3-8B", 1, 1), ("meta-llama/Llama-3.1-70B-Instruct", 4, 1),
                ("google/gemma-3-27b-it", 2, 2))
MIXED_SIZES = (256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)

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
    """A generated set: `count` files under `root`, named from `seed`.

    Uniform (`COUNTxSIZE`): every file `size` bytes under one model directory, rank 0.
    Mixed (`mixed:COUNT`): the tree a host serving several deployments sees: files of
    the sizes in MIXED_SIZES spread over the models, ranks and groups of MIXED_LAYOUT,
    each file's size and place drawn from the seed. `size` is then the smallest size,
    the most a head may ask for every file.
    """

    count: int
    size: int
    seed: int
    root: Path
    mixed: bool = False

    @property
    def name(self) -> str:
        return f"mixed{self.count}" if self.mixed else f"{self.count}x{format_size(self.size)}"

    @property
    def model_dir(self) -> Path:
        """The one model directory of a uniform set (the root of a mixed one)."""
        return self.root if self.mixed else self._model_dir(MODEL, 0)

    def _model_dir(self, model: str, rank: int) -> Path:
        fingerprint = hashlib.sha256(f"kvbench:{self.seed}:{self.name}:{model}".encode()) \
            .hexdigest()[:12] if self.mixed else \
            hashlib.sha256(f"kvbench:{self.seed}:{self.name}".encode()).hexdigest()[:12]
        return self.root / f"{model.replace('/', '_')}_{fingerprint}_r{rank}"

    def _digest(self, index: int) -> str:
        return hashlib.sha256(f"kvbench:{self.seed}:{self.name}:{index}".encode()).hexdigest()

    def size_of(self, index: int) -> int:
        if not self.mixed:
            return self.size
        return MIXED_SIZES[int(self._digest(index)[-8:], 16) % len(MIXED_SIZES)]

    def paths(self) -> list[str]:
        """Every file, in generation order (a stable order the benchmarks can rely on)."""
        out = []
        for index in range(self.count):
            h = self._digest(index)
            if self.mixed:
                pick = int(h[-16:-8], 16)
                model, ranks, groups = MIXED_LAYOUT[pick % len(MIXED_LAYOUT)]
                base = self._model_dir(model, (pick >> 4) % ranks)
                group = (pick >> 8) % groups
            else:
                base, group = self.model_dir, 0
            out.append(str(base / h[0:3] / f"{h[3:5]}_g{group}" / f"{h}.bin"))
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.size_of(i) for i in range(self.count))


def dataset(spec: str, seed: int = DEFAULT_SEED, base: Path = DEFAULT_BASE) -> Dataset:
    """Parse 'COUNTxSIZE' (e.g. '2000x4MiB') or 'mixed:COUNT' into a Dataset under base."""
    spec = spec.strip()
    if (mixed := re.fullmatch(r"mixed:(\d+)", spec)) is not None:
        count = int(mixed.group(1))
        if count < 1:
            raise ValueError(f"dataset spec {spec!r}: count must be positive")
        return Dataset(count, min(MIXED_SIZES), seed, Path(base) / f"ds-mixed{count}-seed{seed}",
                       mixed=True)
    match = re.fullmatch(r"(\d+)x(.+)", spec)
    if not match:
        raise ValueError(f"dataset spec {spec!r} is neither COUNTxSIZE (e.g. 2000x4MiB) "
                         "nor mixed:COUNT")
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
            or manifest.get("seed") != ds.seed or manifest.get("mixed", False) != ds.mixed:
        return False
    for index, path in enumerate(paths if paths is not None else ds.paths()):
        try:
            if os.stat(path).st_size != ds.size_of(index):
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
    written = written_bytes = 0
    for index, path in enumerate(paths):
        size = ds.size_of(index)
        try:
            if os.stat(path).st_size == size:
                continue
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_file(path, size, index, pool)
        written += 1
        written_bytes += size
        if not quiet and written % 1000 == 0:
            print(f"  {ds.name}: {written} files written", file=sys.stderr)
    os.sync()  # dirty pages cannot be dropped: the cold step needs them on disk
    (ds.root / MANIFEST).write_text(json.dumps(
        {"count": ds.count, "size": ds.size, "seed": ds.seed, "mixed": ds.mixed,
         "models": [m for m, _, _ in MIXED_LAYOUT] if ds.mixed else [MODEL],
         "total_bytes": ds.total_bytes,
         "layout": "<root>/<safe_model>_<fp12>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin"},
        indent=1) + "\n")
    if not quiet:
        print(f"  {ds.name}: wrote {written} files ({written_bytes / 1e9:.2f} GB) in "
              f"{time.monotonic() - started:.1f} s under {ds.root}", file=sys.stderr)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", metavar="SPEC",
                        help="COUNTxSIZE (e.g. 2000x4MiB) or mixed:COUNT")
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
