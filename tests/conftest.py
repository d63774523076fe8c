"""Fixtures shared by every test directory; the helpers themselves live in bench/kvharness.

(Test modules import helpers from kvharness, which the benchmarks share, never from
conftest nor from each other: pytest loads every conftest.py under the same module name,
so `from conftest import` may pick up another directory's, and a test module imported
by another runs its module-level code twice under two names.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvharness.attack import ListedRouter
from kvharness.daemon import Daemon, start_cli

# Every property test, on a shared 2-CPU machine: how long an example or its generation
# takes is not the property (a @settings on a test overrides only what it names).
settings.register_profile("shared_host", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared_host")


@pytest.fixture
def kv(tmp_path: Path) -> Path:
    """An empty root for a daemon: tmp_path/kv (where start_cli puts its root too)."""
    root = tmp_path / "kv"
    root.mkdir()
    return root


@pytest.fixture
def tier_files(tmp_path: Path) -> tuple[Path, Path]:
    """A backing directory and a mount point for the slow-tier simulator
    (kvharness.fixtures.mount_tier): tmp_path/backing and tmp_path/mnt, both empty."""
    backing, mountpoint = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mountpoint.mkdir()
    return backing, mountpoint


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    """start_cli in the test's tmp_path (root tmp_path/kv unless root=...; config keys
    without a flag as settings={...}); every daemon started is killed at teardown,
    whatever the test did to it."""
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
