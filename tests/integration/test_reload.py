"""SIGHUP re-reads the configuration without dropping the socket or queued work."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from kvharness.daemon import Daemon


def reload_and_wait(d: Daemon, marker: str) -> None:
    before = d.log().count(marker)
    d.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.log().count(marker) == before:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)


def test_sighup_applies_new_limits_and_keeps_queued_work(
    daemon_factory: Any, tmp_path: Path
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("queue_limit = 10\n")
    d: Daemon = daemon_factory("--config", str(config), "--workers", "1")
    (pid,) = d.worker_pids()
    os.kill(pid, signal.SIGSTOP)  # the 10 queued files stay queued across the reload
    try:
        first = d.call("prefetch", paths=[str(d.root / f"{i}.bin") for i in range(12)])
        assert (first["accepted"], first["dropped"]) == (10, 2)
        config.write_text('queue_limit = 15\nengine = "pread"\n')
        reload_and_wait(d, "configuration reloaded")
        second = d.call("prefetch", paths=[str(d.root / f"x{i}.bin") for i in range(12)])
        assert (second["accepted"], second["dropped"]) == (5, 7)
        assert d.call("stats")["stats"]["workers"][0]["queue_depth"] == 15
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "need a restart keep their old values: engine" in d.log()
    assert len(d.worker_pids()) == 1 and d.worker_pids() == [pid]


def test_an_invalid_file_is_refused_and_the_old_config_stays(
    daemon_factory: Any, tmp_path: Path
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("read_bytes = 4096\n")
    d: Daemon = daemon_factory("--config", str(config))
    config.write_text("read_bytes = -1\n")
    reload_and_wait(d, "reload refused")
    assert "read_bytes" in d.log()
    assert d.call("ping")["ok"]
    config.write_text("read_bytes = [\n")
    reload_and_wait(d, "reload refused")
    stats = d.call("stats")["stats"]
    assert stats["events"]["reload_refused"] == 2
