"""A FUSE root's requests are judged by its connection's count, end to end (native/gauge.c).

A real daemon over the slow-tier simulator (2 fetch slots of 100 ms: 20 fetches a second).
The supervisor names the root's fusectl directory, the worker hands it to its queue, and
the queue learns from its reads the rate the tier answers at: the worker's stats show it
(the third figure of `queue.depth`). `admit_by_tier_count = false` leaves every root to
its reads' own times: no rate is learned.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness.daemon import Daemon, start_config
from kvharness.files import write_all
from kvharness.fixtures import mount_tier
from kvharness.realtier import fuse_connection

KiB = 1 << 10
FILES = 16
RATE = 20  # the tier's fetches a second: 2 slots of 100 ms


@pytest.fixture
def tier(tier_files: tuple[Path, Path]) -> Iterator[Any]:
    with mount_tier(*tier_files, latency_ms=100, slots=2) as mounted:
        if not (fuse_connection(mounted.mountpoint) / "waiting").exists():
            pytest.skip("fusectl cannot be read here (not root)")
        (mounted.backing / "kv").mkdir()
        write_all((mounted.backing / "kv" / f"{i:02d}.bin" for i in range(FILES)), 16 * KiB,
                  cold=False)  # the tier's model makes them cold
        mounted.evict_all()
        yield mounted


def served(tmp_path: Path, tier: Any, **settings: object) -> list[int]:
    """Each worker's learned rate for the root after a request of FILES cold files."""
    daemon: Daemon = start_config(tmp_path, {"roots": [str(tier.mountpoint)], "workers": 2,
                                             "read_bytes": 16 * KiB, **settings})
    try:
        paths = [str(tier.mountpoint / "kv" / f"{i:02d}.bin") for i in range(FILES)]
        reply = daemon.call("prefetch", paths=paths, wait=True, deadline_ms=30_000,
                            timeout_ms=60_000)
        assert reply["outcomes"]["read"] == FILES, reply
        def rates() -> list[int]:
            workers = daemon.call("stats")["stats"]["workers"]
            # a reported queue counts its standby reads: none, as nothing was refused
            assert all(w["queue"].get("standby_reads") == 0 for w in workers if w["queue"])
            return [w["queue"].get("depth", {}).get("0", [0, 0, 0])[2] for w in workers]
        # the workers report their queues a moment after the reads, with their next report
        deadline = time.monotonic() + 5
        while not any(rates()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return rates()
    finally:
        daemon.stop()


def test_the_workers_learn_the_rate_the_tier_answers_at(tmp_path: Path, tier: Any) -> None:
    rates = served(tmp_path, tier)
    assert any(rates) and all(0 <= rate <= 2 * RATE for rate in rates), rates
    assert max(rates) >= RATE * 0.5, rates


def test_without_the_count_no_rate_is_learned(tmp_path: Path, tier: Any) -> None:
    assert served(tmp_path, tier, admit_by_tier_count=False) == [0, 0]
