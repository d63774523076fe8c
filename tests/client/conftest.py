"""Client tests: the kvprefetch package from this tree, against a fake daemon on a real socket."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

CLIENT_SRC = Path(__file__).resolve().parents[2] / "clients" / "python"
# Test the tree, not whatever copy may be installed; also works before the native extension
# (which `pip install -e .` builds) exists.
sys.path.insert(0, str(CLIENT_SRC))

from fake_daemon import FakeDaemon  # noqa: E402


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(str(tmp_path / "d.sock"))
    yield fake
    fake.stop()
