"""The Python client and CLI against the real daemon (the fake one lives in tests/client)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from kvharness.daemon import Daemon
from kvharness.files import make_file
from kvprefetch import AsyncClient, Client


def test_sync_client_covers_ping_prefetch_and_stats(daemon: Daemon) -> None:
    files = [str(make_file(daemon.root / f"c{i}.bin", 256 * 1024)) for i in range(10)]
    with Client(daemon.socket_path) as client:
        ping = client.ping()
        assert ping.protocol == 1 and ping.workers == 2
        ack = client.prefetch(files)
        assert (ack.accepted, ack.dropped, ack.rejected, ack.outcomes) == (10, 0, 0, None)
        done = client.prefetch([*files, "/etc/passwd"], wait=True, timeout_ms=10_000)
        assert done.accepted == 10 and done.rejected == 1 and done.outcomes is not None
        assert done.outcomes["read"] + done.outcomes["resident"] == 10
        assert client.stats()["files"]["accepted"] == 20


def test_async_client_pipelines_on_one_connection(daemon: Daemon) -> None:
    files = [str(make_file(daemon.root / f"a{i}.bin", 64 * 1024)) for i in range(20)]

    async def run() -> list[int]:
        async with AsyncClient(daemon.socket_path) as client:
            replies = await asyncio.gather(
                *(client.prefetch([path], wait=True) for path in files)
            )
            return [r.accepted for r in replies]

    assert asyncio.run(run()) == [1] * 20


def test_cli_warm_wait_json(daemon: Daemon, tmp_path: Path) -> None:
    target = make_file(daemon.root / "cli.bin", 128 * 1024)
    env = {**os.environ, "KVPREFETCHD_SOCKET": daemon.socket_path}
    result = subprocess.run(
        [sys.executable, "-m", "kvprefetch", "warm", "--wait", "--json", str(target)],
        capture_output=True, text=True, env=env, check=False, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["accepted"] == 1 and out["outcomes"]["read"] == 1


def test_cli_exit_3_names_the_socket_when_no_daemon(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.sock")
    result = subprocess.run(
        [sys.executable, "-m", "kvprefetch", "--socket", missing, "ping"],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert result.returncode == 3 and missing in result.stderr


def test_cli_resolve_and_warm_request(daemon: Daemon, tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "hash": {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
                 "vllm_version": "0.23.0"},
        "layout": {"root_dir": str(daemon.root), "model_name": "org/m", "fingerprint":
                   "0123456789ab", "kv_cache_groups": [{"block_size": 16}],
                   "connector_block_size_tokens": 16},
    }))
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([list(range(40)), list(range(100, 132))]))
    env = {**os.environ, "KVPREFETCHD_SOCKET": daemon.socket_path}

    def cli(*args: str) -> dict[str, object]:
        result = subprocess.run(
            [sys.executable, "-m", "kvprefetch", *args, "--json", "--profile", str(profile),
             "--tokens", str(tokens)],
            capture_output=True, text=True, env=env, check=False, timeout=60,
        )
        assert result.returncode == 0, result.stderr
        out: dict[str, object] = json.loads(result.stdout)
        return out

    resolved = cli("resolve")
    hashes = resolved["block_hashes"]
    assert isinstance(hashes, list) and [len(chain) for chain in hashes] == [2, 2]
    paths = resolved["paths"]
    assert isinstance(paths, list) and len(paths) == 4
    assert resolved["fingerprint"] == "0123456789ab"
    for path in paths[:3]:
        make_file(Path(str(path)), 4096)
    warmed = cli("warm-request", "--wait")
    assert warmed["files"] == 4
    assert warmed["outcomes"] == {"read": 3, "resident": 0, "missing": 1, "rejected": 0,
                                  "failed": 0, "expired": 0, "futile": 0}
