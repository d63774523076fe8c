"""Fixtures shared by every test directory; the helpers themselves live in bench/kvharness.

(Test modules import helpers from kvharness, which the benchmarks share, never from
conftest: pytest loads every conftest.py under the same module name, so
`from conftest import` may pick up another directory's.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness.attack import ListedRouter
from kvharness.daemon import Daemon, start_cli


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    """start_cli in the test's tmp_path (root tmp_path/kv unless root=...); every daemon
    started is killed at teardown, whatever the test did to it."""
    started: list[Daemon] = []

    def factory(*args: str, **kwargs: Any) -> Daemon:
        instance = start_cli(tmp_path, *args, **kwargs)
        started.append(instance)
        return instance

    yield factory
    for instance in started:
        instance.kill()


@pytest.fixture
def daemon(daemon_factory: Any) -> Daemon:
    instance: Daemon = daemon_factory()
    return instance


@pytest.fixture
def listed_router(tmp_path: Path) -> ListedRouter:
    """A TLS listener's files and a router it lists (kvharness.attack.ListedRouter): give
    the daemon `.settings()` or `.args()`, and Watch `router=listed_router`."""
    return ListedRouter.make(tmp_path)
