"""Client tests: the kvprefetch package from this tree (pyproject's pytest `pythonpath`
puts clients/python first, so not whatever copy may be installed), against a fake
daemon on a real socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_daemon import FakeDaemon


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(str(tmp_path / "d.sock"))
    yield fake
    fake.stop()
