"""The CLI's `--wait` on a slow tier follows the work, not a clock (issue 24, item 8).

A real daemon over the tier simulator (bench/tiersim) at 100 ms per fetch with 2 fetch
slots: 60 cold files take about 3 s, longer than the CLI's `--timeout 2`. 0.4.0 gave up
there ("no reply in time", exit 1) while the daemon went on warming. The CLI must wait as
long as the daemon answers, show progress off a terminal, and give up (exit 1, saying why)
only when the daemon stops answering: stopped (SIGSTOP) or killed (SIGKILL) mid-wait.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness.daemon import Daemon, start_config
from kvharness.files import write_all
from kvharness.fixtures import mount_tier

KiB = 1 << 10
FILES = 60
TIMEOUT_S = 2  # the CLI's --timeout: less than the warm-up takes
LATENCY_MS = 100
SLOTS = 2  # so 60 files take 30 waves of 100 ms: about 3 s
GIVE_UP_BOUND_S = 12  # a stopped daemon is given up on within --timeout plus a probe


@pytest.fixture
def tier(tier_files: tuple[Path, Path]) -> Iterator[Any]:
    with mount_tier(*tier_files, latency_ms=LATENCY_MS, slots=SLOTS) as mounted:
        yield mounted


def cold_list(tier: Any, tmp_path: Path, directory: str = "kv", count: int = FILES) -> Path:
    """`count` files on the tier, none fetched yet, and a list of them."""
    (tier.backing / directory).mkdir()
    write_all((tier.backing / directory / f"{i:03d}.bin" for i in range(count)), 16 * KiB,
              cold=False)  # the tier's model makes them cold, not the host's page cache
    tier.evict_all()
    listing = tmp_path / f"{directory}.list"
    listing.write_text("".join(f"{tier.mountpoint / directory}/{i:03d}.bin\n"
                               for i in range(count)))
    return listing


def start(tmp_path: Path, tier: Any, **settings: object) -> Daemon:
    return start_config(tmp_path, {"roots": [str(tier.mountpoint)], "workers": 2,
                                   "read_bytes": 16 * KiB, **settings})


def command(daemon: Daemon, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvprefetch", "--socket", str(daemon.socket_path),
            "--timeout", str(TIMEOUT_S), *args]


def run(daemon: Daemon, *args: str) -> tuple[subprocess.CompletedProcess[bytes], float]:
    started = time.monotonic()
    done = subprocess.run(command(daemon, *args), capture_output=True, timeout=60,
                          check=False)
    return done, time.monotonic() - started


def test_a_list_slower_than_the_timeout_is_waited_for_with_progress(
    tmp_path: Path, tier: Any
) -> None:
    """Every file's outcome, exit 0, and progress lines on stderr (not a terminal) at the
    pace asked, with the files settled so far."""
    listing = cold_list(tier, tmp_path)
    daemon = start(tmp_path, tier)
    try:
        done, elapsed = run(daemon, "--json", "warm", "--wait", "--progress", "1",
                            "-f", str(listing))
        fetches = tier.stats().fetches
    finally:
        daemon.kill()
    assert done.returncode == 0, done.stderr.decode()
    out = json.loads(done.stdout)
    assert out["files"] == FILES and out["outcomes"]["read"] == FILES, out
    assert fetches >= FILES
    assert elapsed > TIMEOUT_S, f"{elapsed:.1f} s: the tier was not slower than the timeout"
    lines = done.stderr.decode().splitlines()
    progress = [line for line in lines if line.startswith("kvprefetch warm: ")]
    assert progress, lines  # at least one line a second past the first second
    assert all(f"of {FILES} files settled" in line for line in progress), progress
    assert len(progress) <= elapsed + 1, progress  # one a second at most: no spam


def test_check_and_evict_of_a_list_slower_than_the_timeout(tmp_path: Path, tier: Any) -> None:
    """check and evict wait as warm does: their lookups held for longer than --timeout
    (a tier slow to answer metadata), they still end with every file's state."""
    listing = cold_list(tier, tmp_path, count=20)
    daemon = start(tmp_path, tier, allow_evict=True)
    try:
        results = {}
        for verb in ("check", "evict"):
            tier.hold("stat", "/kv/")
            checker = subprocess.Popen(command(daemon, "--json", verb, "-f", str(listing)),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            tier.wait_held(1)
            # Longer than --timeout, on the CLI's own clock: it is waiting, not finished.
            deadline = time.monotonic() + TIMEOUT_S + 1
            while time.monotonic() < deadline:
                assert checker.poll() is None, checker.communicate()
                time.sleep(0.1)
            tier.release("stat", "/kv/")
            stdout, stderr = checker.communicate(timeout=30)
            results[verb] = (checker.returncode, stdout, stderr)
    finally:
        tier.release()
        daemon.kill()
    for verb, (code, stdout, stderr) in results.items():
        assert code == 0, (verb, stderr.decode())
        states = json.loads(stdout)["states"]
        assert sum(states.values()) == 20 and states.get("cold", 0) == 20, (verb, states)


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_daemon_that_stops_answering_mid_wait_is_given_up_on(
    tmp_path: Path, tier: Any, sig: signal.Signals
) -> None:
    """Stopped: nothing answers, the connection stays up; killed: the connection breaks.
    Either way exit 1 within a bound, saying what happened and how far it got."""
    listing = cold_list(tier, tmp_path)
    daemon = start(tmp_path, tier)
    try:
        cli = subprocess.Popen(command(daemon, "warm", "--wait", "-f", str(listing)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 15
        while tier.stats().fetches < 2:  # the batch reached the workers: the CLI waits
            assert time.monotonic() < deadline and cli.poll() is None, cli.communicate()
            time.sleep(0.02)
        os.kill(daemon.process.pid, sig)
        signalled = time.monotonic()
        _, stderr = cli.communicate(timeout=30)
        gave_up_after = time.monotonic() - signalled
    finally:
        if sig == signal.SIGSTOP:
            os.kill(daemon.process.pid, signal.SIGCONT)
        daemon.kill()
    message = stderr.decode()
    assert cli.returncode == 1, (cli.returncode, message)
    assert gave_up_after < GIVE_UP_BOUND_S, gave_up_after
    if sig == signal.SIGSTOP:
        assert f"answered nothing for {TIMEOUT_S}" in message, message
    else:
        assert "closed the connection" in message, message
    assert f"of {FILES} files settled" in message, message
