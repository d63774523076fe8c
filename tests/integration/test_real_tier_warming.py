"""What the daemon makes of real FUSE tiers (issue 24): warm-ups judged where the consumer
reads. s3fs and rclone mounted over a local S3 endpoint behind a delay proxy
(kvharness.realtier); the proxy counts what the consumer still had to fetch.

- s3fs with its defaults drops a file's pages at every open and throws its own copy away
  at the last close: the daemon holds each warmed file open until its consumer opens it
  (holds.py), `check` says so without an open of its own, and the consumer, another
  process, sends the endpoint no GET; its open lets the file go.
- s3fs with `kernel_cache` keeps the pages across opens, but an open of a file nobody
  has open costs a HEAD: the daemon holds what it reads and what it finds warm, and the
  consumer's opens send the endpoint nothing.
- rclone without a VFS cache keeps nothing for the next open: the daemon finds out by
  reopening a warmed file (reopen.py); no file is `read`, every one is `futile` with reason
  `not_kept`, `check` agrees, stats and metrics flag the root, and `doctor` says why and
  names the fix. Once the verdict is in, no data is fetched there (a lookup only).
- rclone with `--vfs-cache-mode full` keeps what was read in its disk cache: `check` looks
  there (a stat, no open on the mount) and a second warm-up is answered `resident`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvharness import realtier
from kvharness.daemon import Daemon
from kvharness.wire import RawConnection

FILES = 16
SIZE = 1 << 20
DELAY_MS = 5.0
SETTLE_S = 1.0


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[realtier.Endpoint, realtier.DelayProxy]]:
    try:
        realtier.check_available()
    except realtier.RealTierUnavailable as error:  # pragma: no cover - CI requires them
        if realtier.required():
            raise
        pytest.skip(str(error))
    with realtier.endpoint(tmp_path_factory.mktemp("endpoint"), FILES, SIZE,
                           DELAY_MS) as pair:
        yield pair


def mounted(kind: str, config: str, endpoint: tuple[realtier.Endpoint, realtier.DelayProxy],
            tmp_path_factory: pytest.TempPathFactory) -> Any:
    return realtier.mount(kind, config, endpoint[1].url,
                          tmp_path_factory.mktemp(f"{kind}-{config}"), files=FILES,
                          settle=SETTLE_S)


def call(daemon: Daemon, op: str, **fields: Any) -> dict[str, Any]:
    with RawConnection(daemon.socket_path, 120) as connection:
        reply: dict[str, Any] = connection.call(op, **fields)
    assert reply["ok"], reply
    return reply


def open_files_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as limits:
        line = next(line for line in limits if line.startswith("Max open files"))
    return int(line.split()[3])


def held_files(daemon: Daemon) -> int:
    return sum(w["queue"].get("held_files", 0) for w in daemon.stats()["workers"])


def wait_for(condition: Callable[[], bool], daemon: Daemon, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, daemon.stats()["workers"]
        time.sleep(0.05)


def consume_elsewhere(paths: list[str]) -> None:
    """The consumer: another process that opens and reads each file whole."""
    code = ("import sys\nfor p in sys.argv[1:]:\n"
            "    with open(p, 'rb', buffering=0) as f:\n"
            "        while f.read(1 << 20): pass\n")
    subprocess.run([sys.executable, "-c", code, *paths], check=True, timeout=120)


def test_s3fs_defaults_warm_ups_are_held_open_until_the_consumer_opens_them(
        endpoint: tuple[realtier.Endpoint, realtier.DelayProxy],
        tmp_path_factory: pytest.TempPathFactory, daemon_factory: Any) -> None:
    proxy = endpoint[1]
    with mounted("s3fs", "defaults", endpoint, tmp_path_factory) as fs:
        paths = fs.paths()
        daemon: Daemon = daemon_factory(root=fs.path)
        root = daemon.stats()["roots"][0]
        assert (root["fstype"], root["keep"], root["extent"]) == ("fuse.s3fs", "hold", "whole")
        for worker in daemon.stats()["workers"]:  # room for its share of held files
            assert open_files_limit(worker["pid"]) >= 1024 + 512 + 2048
        reply = call(daemon, "prefetch", paths=paths, wait=True, timeout_ms=60_000)
        assert reply["outcomes"]["read"] == FILES, reply
        states = call(daemon, "check", paths=paths)["states"]
        assert states["resident"] == FILES, states  # held: said without an open
        wait_for(lambda: held_files(daemon) == FILES, daemon)
        before = proxy.counts()
        consume_elsewhere(paths)
        consumer = realtier.requests_between(before, proxy.counts())
        assert consumer["GET"] == 0, consumer  # served from what the held files kept

        # The consumer's opens let them go.
        wait_for(lambda: sum(w["hold_released"]["opened"] for w in daemon.stats()["workers"])
                 == FILES and held_files(daemon) == 0, daemon)


def released_on_open(daemon: Daemon) -> int:
    return sum(w["hold_released"]["opened"] for w in daemon.stats()["workers"])


def sent_by_opening_and_reading(paths: list[str],
                                proxy: realtier.DelayProxy) -> dict[str, int]:
    """What a consumer's opens and reads of `paths` sent the endpoint, counted before it
    closes any: s3fs forgets a file's attributes at every close (`s3fs_flush`), after
    which whoever closes it next, the daemon letting it go included, sends a HEAD of its
    own, which is not the consumer's. os.open and os.read only (open() would fstat: a
    getattr)."""
    before = proxy.counts()
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    try:
        for fd in fds:
            while os.read(fd, 1 << 20):
                pass
        return realtier.requests_between(before, proxy.counts())
    finally:
        for fd in fds:
            os.close(fd)


def test_s3fs_kernel_cache_files_found_warm_are_held_and_their_consumer_sends_nothing(
        endpoint: tuple[realtier.Endpoint, realtier.DelayProxy],
        tmp_path_factory: pytest.TempPathFactory, daemon_factory: Any) -> None:
    """kernel_cache keeps the pages across opens, but s3fs sends a HEAD at every open of a
    file nobody has open: a file warm but let go costs its consumer as much as a cold one.
    So the daemon holds every file it warms or finds warm there, and again after a
    consumer has let one go; the consumer's open then sends nothing."""
    proxy = endpoint[1]
    with mounted("s3fs", "kernel_cache", endpoint, tmp_path_factory) as fs:
        paths = fs.paths()
        consume_elsewhere(paths[: FILES // 2])  # warm in the page cache, and let go
        assert sent_by_opening_and_reading(paths[:1], proxy)["HEAD"] > 0  # not held: a HEAD
        daemon: Daemon = daemon_factory(root=fs.path)
        assert daemon.stats()["roots"][0]["keep"] == "pagecache"
        opened = 0
        for round_ in ("first", "again"):  # again: within the memory of recent reads
            reply = call(daemon, "prefetch", paths=paths, wait=True, timeout_ms=60_000)
            outcomes = reply["outcomes"]
            assert outcomes["read"] + outcomes["resident"] == FILES, (round_, reply)
            # The host's reclaimer may take pages of a file found warm: it is read instead.
            assert outcomes["resident"] >= (1 if round_ == "first" else FILES // 2), reply
            wait_for(lambda: held_files(daemon) == FILES, daemon)
            sent = sent_by_opening_and_reading(paths, proxy)  # the consumer: this process
            # No HEAD: every open found its file open. (A GET would be the host's reclaimer
            # taking pages of a file s3fs keeps no copy of, which says nothing of the hold.)
            assert sent["HEAD"] == 0, (round_, sent)
            opened += FILES
            wait_for(lambda: released_on_open(daemon) == opened  # noqa: B023
                     and held_files(daemon) == 0, daemon)


def test_rclone_without_a_cache_is_found_futile_and_nothing_says_read(
        endpoint: tuple[realtier.Endpoint, realtier.DelayProxy],
        tmp_path_factory: pytest.TempPathFactory, daemon_factory: Any) -> None:
    proxy = endpoint[1]
    with mounted("rclone", "vfs_off", endpoint, tmp_path_factory) as fs:
        paths = fs.paths()
        daemon: Daemon = daemon_factory(root=fs.path)
        reply = call(daemon, "prefetch", paths=paths, wait=True, timeout_ms=60_000)
        outcomes = reply["outcomes"]
        assert outcomes["futile"] == FILES and outcomes["read"] == 0, reply
        assert {f["reason"] for f in reply["failures"]} == {"not_kept"}
        assert call(daemon, "check", paths=paths)["states"]["futile"] == FILES
        stats = daemon.stats()
        assert stats["roots"][0]["futile"] and stats["files"]["futile"] == FILES
        before = proxy.counts()
        again = call(daemon, "prefetch", paths=paths, wait=True, timeout_ms=60_000)
        assert again["outcomes"]["futile"] == FILES
        assert realtier.requests_between(before, proxy.counts())["GET"] == 0  # none spent
        doctor = call(daemon, "doctor")
        assert doctor["useful"] is False
        (problem,) = [p for p in doctor["roots"][0]["problems"] if p["severity"] == "error"]
        assert "--vfs-cache-mode full" in problem["fix"]
        assert "futile" in daemon.log()


def test_rclone_full_cache_is_seen_in_its_disk_cache_without_an_open(
        endpoint: tuple[realtier.Endpoint, realtier.DelayProxy],
        tmp_path_factory: pytest.TempPathFactory, daemon_factory: Any) -> None:
    proxy = endpoint[1]
    with mounted("rclone", "vfs_full", endpoint, tmp_path_factory) as fs:
        paths = fs.paths()
        daemon: Daemon = daemon_factory(root=fs.path)
        assert daemon.stats()["roots"][0]["keep"] == "fs_cache"
        assert call(daemon, "check", paths=paths)["states"]["resident"] == 0
        reply = call(daemon, "prefetch", paths=paths, wait=True, timeout_ms=60_000)
        assert reply["outcomes"]["read"] == FILES, reply
        before = proxy.counts()
        assert call(daemon, "check", paths=paths)["states"]["resident"] == FILES
        again = call(daemon, "prefetch", paths=paths, wait=True, timeout_ms=60_000)
        assert again["outcomes"]["resident"] == FILES, again
        assert realtier.requests_between(before, proxy.counts()) == {
            "GET": 0, "HEAD": 0, "LIST": 0, "other": 0}
