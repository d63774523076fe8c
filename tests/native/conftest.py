"""Fixtures for the native extension tests (tests/native/native_helpers.py has the helpers)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness.fixtures import mount_tier

sys.path.insert(0, os.path.dirname(__file__))

from native_helpers import ENGINES, KiB, engine_unavailable, open_root, set_canary, write_file


@pytest.fixture(autouse=True)
def canary(tmp_path: Path) -> Iterator[None]:
    """Tells a global page-cache drop (by something else) from an engine bug."""
    set_canary(tmp_path / ".canary")
    yield
    set_canary(None)


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    """Every row of C's engine table; one that cannot run here skips with kvp_engine_detect's
    reason (io_uring refused by the kernel or seccomp, or a build without liburing)."""
    name: str = request.param
    why = engine_unavailable(*ENGINES[name][:2])
    if why:
        pytest.skip(f"{name} unavailable here: {why}")
    return name


class Root:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_root(path)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Root]:
    """A fresh allowed root (tmp_path/root) and its O_PATH fd."""
    path = tmp_path / "root"
    path.mkdir()
    r = Root(path)
    yield r
    os.close(r.fd)


@pytest.fixture
def tmpfs_beneath(root: Root) -> Iterator[Path]:
    """A tmpfs mounted at root/sub: another mount beneath the root (needs CAP_SYS_ADMIN)."""
    sub = root.path / "sub"
    sub.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "kvp-test", str(sub)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield sub
    finally:
        subprocess.run(["umount", "-l", str(sub)], check=False)


@pytest.fixture
def hung_beneath(root: Root, tmp_path: Path) -> Iterator[Any]:
    """The slow-tier simulator mounted at root/tier, its files under /hung/ (f0..f2)
    answering no stat (LOOKUP, GETATTR) until released, and its counters zeroed. Their
    dentries and every attribute were cached for an hour first, so a walk that crosses the
    mount point meets nothing but the hang: an open of a file asks GETATTR (FUSE's
    permission check after the hang dropped its attributes), which never returns."""
    backing = tmp_path / "backing"
    (backing / "hung").mkdir(parents=True)
    for i in range(3):
        write_file(backing / "hung" / f"f{i}", 16 * KiB)
    with mount_tier(backing, root.path / "tier", entry_timeout=3600,
                    attr_timeout=3600) as tier:
        for i in range(3):
            os.stat(root.path / "tier" / "hung" / f"f{i}")
        tier.hold("stat", "/hung/")
        tier.reset_stats()
        try:
            yield tier
        finally:
            tier.release()
