"""The CLI's bulk verbs against the real daemon: lists far larger than the daemon's queues
end with nothing dropped, every file accounted for, and the exit code saying whether all
were warmed. (The 10^6-file run, with its memory, is bench/cli_bulk.py.)"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

from kvharness.daemon import Daemon, start_config
from kvharness.files import evict, write_all
from kvharness.pagecache import resident_bytes
from kvprefetch.aio import AsyncClient
from kvprefetch.bulk import Bulk, read_paths

KiB = 1 << 10


def make_cold(root: Path, count: int, size: int = 4 * KiB) -> list[str]:
    return write_all((root / f"{i % 64:02x}" / f"{i:06d}.bin" for i in range(count)), size)


def kvprefetch(daemon: Daemon, *args: str, stdin: bytes | None = None
               ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "kvprefetch", "--socket", str(daemon.socket_path), *args],
        input=stdin, capture_output=True, timeout=300, check=False)


def start(tmp_path: Path, **settings: object) -> tuple[Daemon, Path]:
    root = tmp_path / "kv"
    root.mkdir()
    daemon = start_config(tmp_path, {"roots": [str(root)], "workers": 2, "read_bytes": 4096,
                                     **settings})
    return daemon, root


def test_a_list_far_past_the_queues_is_warmed_whole(tmp_path: Path) -> None:
    """20,000 cold files through queues of 512 per worker: the CLI paces and resends, so
    nothing is dropped, with and without --wait, and the exit code is 0."""
    daemon, root = start(tmp_path, queue_limit=512)
    try:
        paths = make_cold(root, 20_000)
        listing = tmp_path / "list"
        listing.write_text("".join(f"{p}\n" for p in paths))
        waited = kvprefetch(daemon, "--json", "warm", "--wait", "-f", str(listing))
        for path in paths[::97]:
            evict(path, sync=False)
        fired = kvprefetch(daemon, "warm", "--json", "-f", str(listing))
        stats = daemon.stats()
    finally:
        daemon.stop()
    assert waited.returncode == 0, waited.stderr
    out = json.loads(waited.stdout)
    assert out["files"] == 20_000 and out["dropped"] == 0 and out["accepted"] >= 20_000
    assert out["outcomes"]["read"] + out["outcomes"]["resident"] == 20_000
    assert fired.returncode == 0, fired.stderr
    assert json.loads(fired.stdout)["dropped"] == 0
    assert b"kvprefetch warm:" not in waited.stderr  # no progress line off a terminal
    assert stats["files"]["dropped"] > 0, "the queues never overflowed: nothing was tested"


def test_missing_rejected_and_ignored_files_set_the_exit_code(tmp_path: Path) -> None:
    daemon, root = start(tmp_path)
    try:
        good = make_cold(root, 3)
        listing = "\0".join([*good, str(root / "gone"), "/etc/passwd"]).encode() + b"\0"
        verbose = kvprefetch(daemon, "warm", "--wait", "-v", "-0", "-", stdin=listing)
        only_missing = kvprefetch(daemon, "warm", "--wait", "--ignore-missing", *good,
                                  str(root / "gone"))
        strict = kvprefetch(daemon, "warm", "--wait", *good, str(root / "gone"))
        zero = kvprefetch(daemon, "warm", "--read-bytes", "0", *good)
    finally:
        daemon.stop()
    assert verbose.returncode == 4
    lines = verbose.stdout.decode().splitlines()
    assert f"missing\tENOENT\t{root / 'gone'}" in lines
    assert "rejected\toutside_roots\t/etc/passwd" in lines
    assert (only_missing.returncode, strict.returncode) == (0, 4)
    assert zero.returncode == 2 and b"--read-bytes" in zero.stderr


def test_check_and_evict_from_the_cli(tmp_path: Path) -> None:
    daemon, root = start(tmp_path, allow_evict=True)
    try:
        paths = make_cold(root, 10, 64 * KiB)
        kvprefetch(daemon, "warm", "--wait", *paths[:4])
        check = kvprefetch(daemon, "--json", "check", "--read-bytes", str(64 * KiB), *paths)
        human = kvprefetch(daemon, "check", "-v", paths[0], paths[9])
        evicted = kvprefetch(daemon, "evict", "--whole", *paths[:4])
        after = kvprefetch(daemon, "--json", "check", *paths)
    finally:
        daemon.stop()
    assert check.returncode == 0, check.stderr
    states = json.loads(check.stdout)["states"]
    assert states.get("cold", 0) >= 6 and states.get("resident", 0) + states["cold"] == 10
    text = human.stdout.decode()
    assert f"\t{paths[9]}" in text and text.splitlines()[-2].startswith("files: 2")
    assert evicted.returncode == 0 and evicted.stdout.startswith(b"evicted: 4 files")
    assert json.loads(after.stdout)["states"]["cold"] == 10
    assert all(resident_bytes(p, 64 * KiB) == 0 for p in paths[:4])


def test_progress_is_drawn_while_a_long_list_streams(tmp_path: Path) -> None:
    daemon, root = start(tmp_path)
    try:
        paths = make_cold(root, 3000)
        progress = io.StringIO()

        async def run() -> None:
            async with AsyncClient(daemon.socket_path) as client:
                bulk = Bulk(client, "warm", {}, wait=True, progress=progress)
                stdin = io.BytesIO("".join(f"{p}\n" for p in paths).encode())
                tally = await bulk.run(read_paths(["-"], [], nul=False, stdin=stdin))
                assert tally.paths == 3000 and sum(tally.outcomes.values()) == 3000

        asyncio.run(run())
    finally:
        daemon.stop()
    shown = progress.getvalue()
    assert shown.startswith("\rkvprefetch warm:") and shown.endswith("\n")
    assert "3,000 of 3,000 files" in shown.split("\r")[-1]
