"""SIGHUP re-reads the configuration without dropping the socket or queued work."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from kvharness.daemon import Daemon, start_config
from kvharness.wire import RawConnection


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


def test_a_reload_may_not_add_a_profile_beneath_roots_it_holds_for_a_restart(
    tmp_path: Path,
) -> None:
    """Roots change only at a restart; a reload that adds a root and a profile beneath it
    was accepted, and the profile's discovery then listed the new root and quoted its
    config.json back to clients: now the reload is refused and nothing is read there."""
    kept, held = tmp_path / "kept", tmp_path / "held"
    kept.mkdir()
    base = held / "org_model_0123456789ab"
    (held / "org_model_0123456789ab_r0").mkdir(parents=True)
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_name": "SECRET-FIELD"}))
    d = start_config(tmp_path, {"roots": [str(kept)], "workers": 1})
    config = tmp_path / "kvprefetchd.toml"
    socket_path = d.socket_path
    try:
        config.write_text(
            f'roots = ["{kept}", "{held}"]\nworkers = 1\nsocket = "{socket_path}"\n'
            f'[models.m]\nhash = {{ algo = "sha256_cbor", python_hash_seed = "0", '
            f'block_size = 16, vllm_version = "0.23.0" }}\n'
            f'layout = {{ root_dir = "{held}", model_name = "org/model", '
            f'kv_cache_groups = [{{ block_size = 16 }}], connector_block_size_tokens = 32, '
            f'fingerprint = "discover" }}\n'
        )
        reload_and_wait(d, "reload refused")
        assert "not under an allowed root in force" in d.log()
        connection = RawConnection(socket_path)
        reply = connection.call("resolve", model="m", prompts=[{"token_ids": list(range(32))}])
        connection.close()
        assert reply["ok"] is False and "SECRET" not in json.dumps(reply), reply
        assert "SECRET" not in d.log()
    finally:
        d.kill()
