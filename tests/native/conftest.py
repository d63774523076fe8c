"""Fixtures for the native extension tests (tests/native/native_helpers.py has the helpers)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from native_helpers import ENGINES, engine_unavailable, open_root, set_canary


@pytest.fixture(autouse=True)
def canary(tmp_path: Path) -> Iterator[None]:
    """Tells a global page-cache drop (by something else) from an engine bug."""
    set_canary(tmp_path / ".canary")
    yield
    set_canary(None)


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    """Every row of C's engine table; one that cannot run here skips with kvp_engine_probe's
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
