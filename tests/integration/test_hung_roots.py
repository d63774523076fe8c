"""A bad day on a tiered file system, and a hostile local user, against the real daemon.

The slow-tier simulator's hang modes (bench/tiersim) hold a file system's reads,
listings or stats until released, as a dead tier does; a process whose request the
file system has taken then sleeps uninterruptibly, SIGKILL included. Each test failed
on the first release (issue 14): its supervisor listed directories and stat'ed roots on
its only thread, followed a root planted as a symlink, and left killed workers to pile up.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness.daemon import Daemon, start_config
from kvharness.files import write_all
from kvharness.fixtures import mount_tier
from kvharness.wire import RawConnection
from kvprefetchd.engines import URING_READ

KiB = 1 << 10
HASH = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
        "vllm_version": "0.23.0"}


@pytest.fixture
def tier(tier_files: tuple[Path, Path]) -> Iterator[Any]:
    with mount_tier(*tier_files, latency_ms=1) as mounted:
        yield mounted


def files(directory: Path, count: int, prefix: str = "f") -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)  # made even when count is 0
    return write_all((directory / f"{prefix}{i:03d}.bin" for i in range(count)), 16 * KiB,
                     cold=False)


def ping_ms(daemon: Daemon) -> float:
    started = time.monotonic()
    with RawConnection(daemon.socket_path, 5) as connection:
        assert connection.call("ping")["ok"]
    return (time.monotonic() - started) * 1000


def test_a_hung_listing_never_holds_the_supervisor(tmp_path: Path, tier: Any) -> None:
    """Fingerprint discovery lists root_dir: on a hung tier the scout waits, not the
    supervisor. Pings are answered meanwhile, the request gets `overloaded` at
    fs_timeout, SIGTERM is honoured in time, and the stuck scout is named."""
    mnt = tier.mountpoint
    (tier.backing / "kv" / "org_model_0123456789ab_r0").mkdir(parents=True)
    layout = {"root_dir": str(mnt / "kv"), "model_name": "org/model",
              "kv_cache_groups": [{"block_size": 16}], "connector_block_size_tokens": 32,
              "fingerprint": "discover"}
    daemon = start_config(tmp_path, {"roots": [str(mnt)], "workers": 1, "fs_timeout": 2,
                                     "log_level": "info"})
    try:
        tier.hold("readdir", "/kv")
        tier.hold("stat", "/kv")
        with RawConnection(daemon.socket_path, 30) as stuck:
            stuck.send({"v": 1, "id": 7, "op": "resolve", "hash": HASH, "layout": layout,
                        "prompts": [{"token_ids": list(range(32))}]})
            tier.wait_held(1)
            # The supervisor answers others while the listing hangs in the scout.
            assert max(ping_ms(daemon) for _ in range(5)) < 1000
            reply = stuck.recv()
        assert reply["id"] == 7 and reply["error"]["code"] == "overloaded", reply
        assert "did not answer" in reply["error"]["message"]
        stats = daemon.stats()
        assert stats["scout"]["timeouts"] >= 1
        assert [c["role"] for c in stats["stuck"]] == ["scout"]  # killed, held by the kernel
        started = time.monotonic()
        assert daemon.stop(signal.SIGTERM, timeout=10) == 0
        assert time.monotonic() - started < 5.5  # the promise: out within 5 s
        assert "still stuck in the kernel" in daemon.log()
    finally:
        tier.release()
        daemon.kill()


def test_a_root_planted_as_a_symlink_is_refused_and_nothing_behind_it_is_read(
    tmp_path: Path,
) -> None:
    """A root that does not exist at start, in a world-writable directory: anyone could
    create it as a symlink to a directory they may not read. Refused (and said so), tried
    again, never followed; a real directory put there later is served."""
    public = tmp_path / "public"
    public.mkdir()
    public.chmod(0o1777)  # as /tmp
    root = public / "shared-kv"
    secret = tmp_path / "secret"
    secret_files = files(secret, 4, "s")
    daemon = start_config(tmp_path, {"roots": [str(root)], "workers": 1, "log_level": "info"})
    try:
        assert daemon.stats()["roots"][0]["status"] == "missing"
        root.symlink_to(secret)  # the plant
        planted = [str(root / Path(p).name) for p in secret_files]
        deadline = time.monotonic() + 15
        while daemon.stats()["roots"][0]["status"] != "refused":
            assert time.monotonic() < deadline, daemon.stats()["roots"]
            time.sleep(0.2)
        assert "is a symlink" in daemon.log()
        reply = daemon.call("prefetch", paths=planted, wait=True)
        assert reply["outcomes"]["missing"] == 4 and daemon.stats()["bytes_read"] == 0
        root.unlink()
        served = files(root, 3)  # the connector's real directory
        deadline = time.monotonic() + 15
        while daemon.stats()["roots"][0]["status"] != "open":
            assert time.monotonic() < deadline, daemon.stats()["roots"]
            time.sleep(0.2)
        assert "is open now" in daemon.log()
        outcomes = daemon.call("prefetch", paths=served, wait=True)["outcomes"]
        assert outcomes["read"] + outcomes["resident"] == 3, outcomes  # served: just written
    finally:
        daemon.kill()


def test_a_root_swapped_for_a_symlink_later_changes_nothing_even_after_a_respawn(
    tmp_path: Path,
) -> None:
    root = tmp_path / "kv"
    mine = files(root, 2)
    secret = tmp_path / "secret"
    files(secret, 2, "s")
    daemon = start_config(tmp_path, {"roots": [str(root)], "workers": 1, "log_level": "info"})
    try:
        root.rename(tmp_path / "kv-moved")
        root.symlink_to(secret)
        (pid,) = daemon.worker_pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not (daemon.stats()["worker_restarts"] == 1
                   and daemon.stats()["workers"][0]["ready"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # The held fd is the directory as it was opened: the secret's file (named under the
        # swapped path) is not there; the moved directory's files are.
        reply = daemon.call("prefetch", paths=[str(root / "s000.bin"), *mine], wait=True)
        assert reply["outcomes"]["read"] + reply["outcomes"]["resident"] == 2, reply
        assert reply["outcomes"]["missing"] == 1 and reply["accepted"] == 3
    finally:
        daemon.kill()


@pytest.mark.skipif(URING_READ.unavailable_reason() is not None,
                    reason="io_uring is the batch engine whose worker a hang holds")
def test_workers_stuck_in_a_hung_tier_are_tracked_capped_and_never_left_silently(
    tmp_path: Path, tier: Any
) -> None:
    """A batch engine's worker blocked in a stat the tier never answers is killed as
    wedged, but the kernel holds it: it is tracked, at most max_stuck_workers pile up
    (then its shard waits, dropped and counted), and they are all reaped once the tier
    answers."""
    mnt = tier.mountpoint
    hung = files(tier.backing / "hung", 4)
    hung = [str(mnt / "hung" / Path(p).name) for p in hung]
    daemon = start_config(tmp_path, {"roots": [str(mnt)], "workers": 1, "engine": "io_uring",
                                     "worker_timeout": 1, "max_stuck_workers": 2,
                                     "residency_by_root": {str(mnt): "off"},
                                     "log_level": "info"})
    try:
        tier.hold("stat", "/hung")
        for round_ in range(2):
            assert daemon.call("prefetch", paths=[hung[round_]])["accepted"] == 1
            deadline = time.monotonic() + 15
            while len(daemon.stats()["stuck"]) < round_ + 1:
                assert time.monotonic() < deadline, daemon.stats()
                time.sleep(0.1)
        stats = daemon.stats()
        assert [c["role"] for c in stats["stuck"]] == ["worker", "worker"]
        assert stats["workers_killed_wedged"] == 2
        # The cap: no third worker is forked into the same hang.
        deadline = time.monotonic() + 5
        while "not respawned while 2 killed workers are stuck" not in daemon.log():
            assert time.monotonic() < deadline, daemon.log()[-2000:]
            time.sleep(0.1)
        assert daemon.call("prefetch", paths=[hung[2]])["dropped"] == 1
        tier.release()
        deadline = time.monotonic() + 15
        while daemon.stats()["stuck"] or not daemon.stats()["workers"]:
            assert time.monotonic() < deadline, daemon.stats()
            time.sleep(0.1)
        assert daemon.call("prefetch", paths=[hung[3]], wait=True)["outcomes"]["read"] == 1
    finally:
        tier.release()
        daemon.kill()
