"""Fingerprint discovery is the one place the supervisor itself touches the file system,
and an inline layout lets the client choose where. Before the fix, a `resolve` naming any
directory made the supervisor list it and read any `<dir>/<model>_<12 hex>/config.json`,
quoting its fields back in the error; a FIFO named config.json there blocked the
supervisor's only thread, and with it every client, for ever."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvharness.daemon import Daemon
from open_audit import OpenAudit

HASH = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
        "vllm_version": "0.23.0"}
PROMPTS = [{"token_ids": list(range(32))}]


def layout(root_dir: Path | str) -> dict[str, Any]:
    return {"root_dir": str(root_dir), "model_name": "org/model", "tp_size": 2,
            "kv_cache_groups": [{"block_size": 16}], "connector_block_size_tokens": 32,
            "fingerprint": "discover"}


def plant(directory: Path, *, fifo: bool) -> Path:
    """A folder the connector might have written, with a config.json holding a 'secret'."""
    (directory / "org_model_0123456789ab_r0").mkdir(parents=True)
    base = directory / "org_model_0123456789ab"
    base.mkdir()
    if fifo:
        os.mkfifo(base / "config.json")
    else:
        (base / "config.json").write_text(json.dumps({"model_name": "SECRET-FIELD"}))
    return base


def call_within(daemon: Daemon, seconds: float, op: str, **fields: Any) -> dict[str, Any]:
    connection = daemon.connect()
    connection.sock.settimeout(seconds)
    try:
        return connection.call(op, **fields)
    finally:
        connection.close()


def test_an_inline_layout_may_not_make_the_supervisor_look_outside_the_roots(
    daemon: Daemon, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    secret = plant(elsewhere, fifo=False)
    (daemon.root / "link-out").symlink_to(elsewhere)
    audit = OpenAudit(elsewhere, secret)
    try:
        for root_dir in (elsewhere, daemon.root / "link-out", f"{daemon.root}/../elsewhere"):
            reply = call_within(daemon, 10, "resolve", hash=HASH, layout=layout(root_dir),
                                prompts=PROMPTS)
            assert reply["error"]["code"] == "bad_request", reply
            assert "not under an allowed root" in reply["error"]["message"]
            assert "SECRET" not in json.dumps(reply)
        opened = audit.events()
    finally:
        audit.close()
    assert opened == [], opened  # not even the directory listing


def test_a_fifo_named_config_json_inside_a_root_does_not_wedge_the_daemon(
    daemon: Daemon,
) -> None:
    plant(daemon.root / "kvtree", fifo=True)
    reply = call_within(daemon, 10, "resolve", hash=HASH, layout=layout(daemon.root / "kvtree"),
                        prompts=PROMPTS)
    # The only folder has no readable config.json to contradict it: discovery picks it.
    assert reply["ok"] and reply["fingerprint"] == "0123456789ab", reply
    assert call_within(daemon, 10, "ping")["ok"]  # before the fix: a timeout, for ever
