"""The order files wait in, through the real daemon on the slow-tier simulator (issue 25).

The daemon keeps 4 reads in flight per worker (max_in_flight), so its queues hold the
backlog (native/schedule.c picks from them). Judged by state, never by time: when a
request's `wait` reply comes, how many files of the other requests are still unsettled.

- Newest request first: a request sent after a 300-file request of the same client is
  answered while most of the older one still waits.
- Clients take turns: a bulk CLI run (another process) sent after the router's request
  does not hold the router's files back behind its own.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness.daemon import Daemon, start_config
from kvharness.files import write_all
from kvharness.fixtures import mount_tier, until
from kvharness.wire import RawConnection

KiB = 1 << 10
LATENCY_MS = 25
IN_FLIGHT = 4  # per worker: the tier serves all 8 at once, the rest wait in the daemon


@pytest.fixture
def tier(tier_files: tuple[Path, Path]) -> Iterator[Any]:
    with mount_tier(*tier_files, latency_ms=LATENCY_MS) as mounted:
        yield mounted


def cold(tier: Any, directory: str, count: int) -> list[str]:
    """`count` files of 16 KiB on the tier under `directory`, none fetched yet."""
    write_all((tier.backing / directory / f"{i:04d}.bin" for i in range(count)), 16 * KiB,
              cold=False)  # the tier's model makes them cold, not the host's page cache
    tier.evict_all()
    return [f"{tier.mountpoint}/{directory}/{i:04d}.bin" for i in range(count)]


def warm(daemon: Daemon, paths: list[str], wait: bool = True) -> dict[str, Any]:
    with RawConnection(daemon.socket_path, 120) as connection:
        reply: dict[str, Any] = connection.call("prefetch", paths=paths, wait=wait,
                                                timeout_ms=60_000)
    assert reply["ok"] and reply["accepted"] == len(paths), reply
    return reply


def unsettled(daemon: Daemon) -> int:
    return int(daemon.stats()["files"]["in_flight"])


@pytest.fixture
def daemon(tmp_path: Path, tier: Any) -> Iterator[Daemon]:
    """A daemon with 4 reads in flight per worker: the backlog waits in its queues."""
    instance = start_config(tmp_path, {"roots": [str(tier.mountpoint)], "workers": 2,
                                       "max_in_flight": IN_FLIGHT, "read_bytes": 16 * KiB,
                                       "dedup_ttl_ms": 0})
    try:
        yield instance
    finally:
        instance.stop()


def test_the_newest_request_goes_before_an_older_ones_backlog(tier: Any,
                                                             daemon: Daemon) -> None:
    older, newer = cold(tier, "older", 300), cold(tier, "newer", 8)
    warm(daemon, older, wait=False)
    reply = warm(daemon, newer)
    left = unsettled(daemon)
    assert reply["outcomes"]["read"] == 8, reply
    assert left >= 200, f"only {left} of the older request's 300 files were still waiting"


def test_a_bulk_run_from_another_client_does_not_hold_the_router_back(
        tier: Any, daemon: Daemon, tmp_path: Path) -> None:
    router, bulk = cold(tier, "router", 200), cold(tier, "bulk", 600)
    listing = tmp_path / "bulk.list"
    listing.write_text("".join(f"{path}\n" for path in bulk))
    replies: list[dict[str, Any]] = []
    waiting = threading.Thread(target=lambda: replies.append(warm(daemon, router)))
    waiting.start()
    until(lambda: unsettled(daemon) >= 150, "the router's files queued")
    # Newer than the router's request, from another process: without turns between
    # clients it would go first, all 600 files of it.
    cli = subprocess.run([sys.executable, "-m", "kvprefetch", "--socket",
                          str(daemon.socket_path), "warm", "-f", str(listing)],
                         capture_output=True, timeout=60, check=False)
    assert cli.returncode == 0, cli.stderr.decode()
    waiting.join(60)
    left = unsettled(daemon)
    assert replies and replies[0]["outcomes"]["read"] == 200, replies
    assert left >= 250, f"only {left} of the bulk run's 600 files were still waiting"
