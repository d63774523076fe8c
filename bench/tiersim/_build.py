"""Build the simulator from source, once per change of its sources or of the toolchain flags.

Never a committed binary: gcc and `pkg-config fuse3` build it into a cache directory
(bench/out/tiersim by default, ignored by git), under a name that is the hash of what went
into it, so a changed source is rebuilt and concurrent builds never replace a binary in use.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from ._system import FuseUnavailable, check_fuse

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE.parent / "out" / "tiersim"
CFLAGS = ["-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-pthread"]


class BuildError(RuntimeError):
    """The simulator's C sources do not compile: a bug, never a reason to skip."""


def sources() -> list[Path]:
    return sorted([*HERE.glob("*.c"), *HERE.glob("*.h")])


def _pkg_config(*args: str) -> list[str]:
    try:
        done = subprocess.run(["pkg-config", *args, "fuse3"], capture_output=True, text=True,
                              check=False, timeout=30)
    except FileNotFoundError as exc:
        raise FuseUnavailable("pkg-config not found: install pkg-config "
                              "(./dev setup does, as root)") from exc
    if done.returncode != 0:
        raise FuseUnavailable("libfuse3 development files not found (pkg-config fuse3: "
                              f"{done.stderr.strip()}): install libfuse3-dev "
                              "(./dev setup does, as root)")
    return done.stdout.split()


def build(cache: Path | None = None) -> Path:
    """The path of a simulator binary built from the current sources (compiled if needed)."""
    check_fuse()
    cache = Path(os.environ.get("TIERSIM_CACHE", cache or DEFAULT_CACHE))
    cflags, libs = _pkg_config("--cflags"), _pkg_config("--libs")
    digest = hashlib.sha256()
    for part in (*CFLAGS, *cflags, *libs):
        digest.update(part.encode() + b"\0")
    for source in sources():
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    binary = cache / f"tiersim-{digest.hexdigest()[:16]}"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.partial")
    command = ["gcc", *CFLAGS, *cflags, "-o", str(partial),
               *(str(s) for s in sources() if s.suffix == ".c"), *libs]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BuildError(f"{' '.join(command)}\n{done.stderr}")
    os.replace(partial, binary)  # atomic: a concurrent build of the same sources is identical
    return binary
