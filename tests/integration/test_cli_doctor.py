"""`kvprefetch doctor` against the real daemon (issue 24, item 4): the daemon's report, the
live probe (evict, warm, check, a consumer's read in the CLI's process) and the exit code.

- A local root: useful, exit 0, the probe warms and the consumer finds the file warm.
- A root that is not there: the daemon says so with the fix, exit 1.
- A real FUSE tier where warming cannot help (rclone without its VFS cache: the kernel
  drops a file's pages at each open, kvharness.realtier): exit 1, naming the fix.
  Not root, no /dev/fuse, or a package missing: skipped with the reason; with
  KVPREFETCH_REQUIRE_REALTIER=1 (CI) a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvharness import realtier
from kvharness.daemon import Daemon, start_config
from kvprefetch import AsyncClient, Client

HEAD = 64 << 10  # the probe's head on the local root: a page-cache read of it takes µs


def kvprefetch(socket_path: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvprefetch", "--socket", socket_path, *args],
        capture_output=True, text=True, timeout=120, check=False)


def start(tmp_path: Path, roots: list[str], **settings: object) -> Daemon:
    return start_config(tmp_path, {"roots": roots, "workers": 1, **settings})


def local_root(tmp_path: Path) -> Path:
    """A root with one file four levels down (the sample walk must find it) and an empty
    file first (which it must pass over)."""
    root = tmp_path / "kv"
    deep = root / "m" / "r0" / "g0"
    deep.mkdir(parents=True)
    (root / "empty.bin").touch()
    (deep / "block.bin").write_bytes(os.urandom(4 * HEAD))
    os.sync()  # written pages are clean, so an evict can drop them
    return root


def test_a_local_root_is_useful_and_its_probe_warms_what_the_consumer_reads(
        tmp_path: Path) -> None:
    root = local_root(tmp_path)
    daemon = start(tmp_path, [str(root)], allow_evict=True)
    try:
        text = kvprefetch(daemon.socket_path, "doctor", "--read-bytes", str(HEAD))
        out = kvprefetch(daemon.socket_path, "doctor", "--json", "--read-bytes", str(HEAD))
        bare = kvprefetch(daemon.socket_path, "--json", "doctor", "--no-probe")
    finally:
        daemon.stop()
    assert text.returncode == 0, text.stdout + text.stderr
    assert f"{root}: " in text.stdout and "residency rule: pagecache" in text.stdout
    assert "useful: yes" in text.stdout and "1 of 1 root can be warmed usefully" in text.stdout
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["useful"] is True and report["daemon_useful"] is True
    [entry] = report["roots"]
    assert entry["fstype"] and entry["rule"] == "pagecache" and entry["extent"] == "head"
    probe = entry["probe"]
    assert probe["path"] == str(root / "m" / "r0" / "g0" / "block.bin")
    assert probe["evicted"] == "by the daemon"
    assert probe["outcome"] in ("read", "resident") and probe["check"] == "resident"
    assert probe["consumer_bytes"] == HEAD  # a head root: the head, as the consumer reads
    assert probe["useful"] is True, probe
    assert bare.returncode == 0, bare.stderr
    assert json.loads(bare.stdout)["roots"][0]["probe"] == {"skipped": "--no-probe"}


def test_without_allow_evict_the_probe_makes_the_file_cold_itself(tmp_path: Path) -> None:
    root = local_root(tmp_path)
    daemon = start(tmp_path, [str(root)])  # allow_evict = false: evict is refused
    try:
        named = str(root / "m" / "r0" / "g0" / "block.bin")
        out = kvprefetch(daemon.socket_path, "doctor", "--json", "--probe", named)
    finally:
        daemon.stop()
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout)["roots"][0]["probe"]
    assert probe["path"] == named and probe["evicted"].startswith("here")
    assert probe["consumer_bytes"] == 4 * HEAD  # the file is smaller than the 1 MiB head


def test_a_root_that_is_not_there_is_not_useful_and_says_the_fix(tmp_path: Path) -> None:
    root = local_root(tmp_path)
    absent = tmp_path / "not-mounted"
    daemon = start(tmp_path, [str(root), str(absent)], allow_evict=True)
    try:
        out = kvprefetch(daemon.socket_path, "doctor", "--read-bytes", str(HEAD))
    finally:
        daemon.stop()
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{absent}: unknown type (missing)" in out.stdout
    assert "live probe: skipped (the root is missing)" in out.stdout
    assert "fix: create the directory or mount the file system" in out.stdout
    assert "1 of 2 roots can be warmed usefully" in out.stdout


def test_usage_errors_and_an_absent_daemon_have_the_clis_exit_codes(tmp_path: Path) -> None:
    root = local_root(tmp_path)
    daemon = start(tmp_path, [str(root)])
    try:
        outside = kvprefetch(daemon.socket_path, "doctor", "--probe", "/etc/hostname")
        bad = kvprefetch(daemon.socket_path, "doctor", "--probe-timeout", "0")
    finally:
        daemon.stop()
    assert outside.returncode == 2 and "not under any of the daemon's roots" in outside.stderr
    assert bad.returncode == 2 and "--probe-timeout" in bad.stderr
    absent = kvprefetch(str(tmp_path / "nobody.sock"), "doctor")
    assert absent.returncode == 3 and "cannot connect" in absent.stderr


def test_both_clients_return_the_typed_report(tmp_path: Path) -> None:
    root = local_root(tmp_path)
    daemon = start(tmp_path, [str(root)])

    async def via_asyncio() -> bool:
        async with AsyncClient(daemon.socket_path) as client:
            return (await client.doctor())["useful"]

    try:
        with Client(daemon.socket_path) as client:
            report = client.doctor()
        useful = asyncio.run(via_asyncio())
    finally:
        daemon.stop()
    assert report["useful"] is True and useful is True
    assert report["roots"][0]["root"] == str(root) and report["roots"][0]["problems"] == []
    assert {"engine", "io_uring", "cachestat", "fusectl"} <= set(report["host"])


def test_a_real_tier_that_drops_warm_ups_at_open_fails_and_names_the_fix(
        tmp_path: Path) -> None:
    """rclone without its VFS cache: the consumer's read is as slow as the warm-up (it
    fetches again), or the daemon has found the root futile already: exit 1 either way."""
    try:
        realtier.check_available(("rclone",))
    except realtier.RealTierUnavailable as error:  # pragma: no cover - CI requires them
        if realtier.required():
            raise
        pytest.skip(str(error))
    # 40 ms a way: both reads are round trips, so the consumer's is never half the warm-up's
    with realtier.endpoint(tmp_path / "endpoint", 2, 1 << 20, 40.0) as (_, proxy), \
            realtier.mount("rclone", "vfs_off", proxy.url, tmp_path / "rclone", files=2,
                           settle=0.0) as fs:
        daemon = start(tmp_path, [str(fs.path)], allow_evict=True)
        try:
            out = kvprefetch(daemon.socket_path, "doctor")
            again = kvprefetch(daemon.socket_path, "doctor", "--json")
        finally:
            daemon.stop()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "fuse.rclone" in out.stdout and "max_background" in out.stdout
    assert "NOT USEFUL" in out.stdout
    assert "fix: mount with --vfs-cache-mode full" in out.stdout
    assert again.returncode == 1, again.stdout + again.stderr
    [entry] = json.loads(again.stdout)["roots"]
    assert entry["useful"] is False and entry["probe"]["useful"] is False, entry
    assert entry["probe"]["extent"] == "whole" and entry["probe"]["consumer_bytes"] == 1 << 20
