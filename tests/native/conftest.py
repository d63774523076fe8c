"""Fixtures for the native extension tests (tests/native/native_helpers.py has the helpers)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from native_helpers import ENGINES, open_root, set_canary, uring_unavailable


@pytest.fixture(autouse=True)
def canary(tmp_path: Path) -> Iterator[None]:
    """Tells a global page-cache drop (by something else) from an engine bug."""
    set_canary(tmp_path / ".canary")
    yield
    set_canary(None)


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    """Every engine; the io_uring ones skip with kvp_uring_probe's reason."""
    name: str = request.param
    if ENGINES[name][2]:
        why = uring_unavailable()
        if why:
            pytest.skip(f"io_uring unavailable here: {why}")
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
