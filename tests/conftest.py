"""Fixtures shared by every test directory; the helpers themselves live in daemon_harness.py.

(Test modules import helpers from daemon_harness, never from conftest: pytest
loads every conftest.py under the same module name, so `from conftest import`
may pick up another directory's.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon_harness import Daemon, start_daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Daemon] = []

    def factory(*args: str, **kwargs: Any) -> Daemon:
        instance = start_daemon(tmp_path, *args, **kwargs)
        started.append(instance)
        return instance

    yield factory
    for instance in started:
        if instance.process.poll() is None:
            instance.process.kill()
            instance.process.wait(10)


@pytest.fixture
def daemon(daemon_factory: Any) -> Daemon:
    instance: Daemon = daemon_factory()
    return instance
