"""The KV ops over the real socket: every golden vector through `resolve`, and
`prefetch_blocks` against a KV tree laid out on disk the way the fs connector writes it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from kv_vectors import CHAIN_FILES, one_group_layout, vector, versions_of
from kvharness.daemon import Daemon, command
from kvharness.files import make_file
from kvharness.pagecache import assert_warmed, drops
from open_audit import OpenAudit


def test_every_chain_vector_through_the_resolve_op(daemon: Daemon) -> None:
    connection = daemon.connect()
    checked = 0
    for name in CHAIN_FILES:
        data = vector(name)
        for case in data["cases"]:
            inputs = case["inputs"]
            for version in versions_of(case.get("valid_for_vllm_versions")
                                       or data["valid_for_vllm_versions"]):
                fields = {
                    **inputs,
                    "hash": {**inputs["hash"], "vllm_version": version},
                    "layout": one_group_layout(inputs["hash"]["block_size"]),
                }
                reply = connection.call("resolve", **fields)
                assert reply["ok"], (name, case["id"], version, reply)
                assert reply["block_hashes"] == [case["expected"]["block_hashes_hex"]], (
                    name, case["id"], version)
                checked += 1
    connection.close()
    assert checked > 100


def test_every_path_vector_through_the_resolve_op(daemon: Daemon) -> None:
    connection = daemon.connect()
    for case in vector("fs_connector_paths.json")["cases"]:
        reply = connection.call("resolve", **case["inputs"])
        assert reply["ok"], (case["id"], reply)
        expected = case["expected"]
        assert reply["block_hashes"] == [expected["block_hashes_hex"]], case["id"]
        assert reply["fingerprint"] == expected["digest"], case["id"]
        assert reply["paths"] == [p["path"] for p in expected["paths"]], case["id"]
    connection.close()


def test_every_fingerprint_vector_through_the_resolve_op(daemon: Daemon) -> None:
    connection = daemon.connect()
    data = vector("fs_connector_fingerprint.json")
    checked = 0
    for section in (k for k in data if k.startswith("field_set_")):
        for case in data[section]:
            kwargs = case["inputs"]["constructor_kwargs"]
            size_key = "block_size" if "hash_block_size" in kwargs else "tokens_per_block"
            block = kwargs.get("hash_block_size", kwargs.get("tokens_per_hash"))
            per_file = kwargs.get("gpu_blocks_per_file", kwargs.get("blocks_per_file"))
            groups = kwargs.get("kv_cache_groups", [])
            if not groups:
                continue  # a request always names its KV-cache groups
            layout = {
                key: kwargs[key]
                for key in ("root_dir", "model_name", "tp_size", "pp_size", "pcp_size",
                            "dcp_size", "dtype")
            }
            layout |= {
                "kv_cache_groups": [{"block_size": g[size_key], "layer_names": g["layer_names"]}
                                    for g in groups],
                "connector_block_size_tokens": per_file * block,
                "parallel_agnostic": kwargs.get("parallel_agnostic", False),
                "replicated_layout": kwargs.get("replicated_layout", False),
                "fingerprint_field_set": section.split("_")[2],
            }
            reply = connection.call(
                "resolve",
                hash={"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": block},
                layout=layout,
                prompts=[{"token_ids": list(range(block * per_file))}],
            )
            assert reply["ok"], (case["id"], reply)
            assert reply["fingerprint"] == case["expected"]["digest"], case["id"]
            assert reply["paths"][0].startswith(case["expected"]["rank_dir_example"][:-1]), (
                case["id"])
            checked += 1
    connection.close()
    assert checked > 0


def test_resolve_errors_are_bad_requests_and_the_daemon_goes_on(daemon: Daemon) -> None:
    connection = daemon.connect()
    for fields in (
        {"model": "nope", "prompts": [{"token_ids": [1, 2]}]},
        {"hash": {"algo": "md5"}, "layout": one_group_layout(16),
         "prompts": [{"token_ids": [1]}]},
        {"hash": {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16},
         "layout": one_group_layout(16), "prompts": [{"token_ids": "abc"}]},
    ):
        reply = connection.call("resolve", **fields)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply
        assert reply["error"]["message"]
    assert connection.call("ping")["ok"]
    connection.close()


# ---- prefetch_blocks against a tree on disk ---------------------------------------------

HASH = {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": 16,
        "vllm_version": "0.23.0"}


def layout_for(root: Path, fingerprint: str = "0123456789ab") -> dict[str, Any]:
    return {
        "root_dir": str(root), "model_name": "org/model", "tp_size": 2,
        "kv_cache_groups": [{"block_size": 16}], "connector_block_size_tokens": 32,
        "fingerprint": fingerprint,
    }


def write_config(tmp_path: Path, root: Path, fingerprint: str, streak: int = 256) -> Path:
    layout = layout_for(root, fingerprint)
    lines = [f"stale_streak = {streak}", "[models.m.hash]"]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in HASH.items()]
    lines += ["[models.m.layout]", f'root_dir = "{root}"', 'model_name = "org/model"',
              "tp_size = 2", "connector_block_size_tokens = 32",
              f'fingerprint = "{fingerprint}"', "kv_cache_groups = [{block_size = 16}]"]
    assert layout["fingerprint"] == fingerprint
    path = tmp_path / "kv.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def connector_write(path: Path, size: int) -> None:
    """As the connector does: write `<target>_<random>.tmp`, rename into place; a crashed
    writer's .tmp stays behind next to it."""
    temp = path.with_name(path.name + f"_{os.getpid()}.tmp")
    make_file(temp, size)
    os.rename(temp, path)
    make_file(path.with_name(path.name + "_dead.tmp"), size)


def test_prefetch_blocks_warms_exactly_the_connectors_files(
    daemon_factory: Any, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    config = write_config(tmp_path, root, "0123456789ab")
    d: Daemon = daemon_factory("--config", str(config), root=root)
    prompts = [{"token_ids": list(range(100))}, {"token_ids": list(range(50, 150))}]
    resolved = d.call("resolve", model="m", prompts=prompts)
    assert resolved["ok"], resolved
    paths = [Path(p) for p in resolved["paths"]]
    # 2 prompts x 3 files of 32 tokens (each prompt its own chain) x 2 ranks
    assert len(paths) == 12 and len(set(paths)) == 12
    written = paths[: len(paths) - 2]  # the last two files were never offloaded
    for path in written:
        connector_write(path, 64 * 1024)
    watched = sorted({p.parent for p in written})
    audit = OpenAudit(*watched)
    try:
        reply = d.call("prefetch_blocks", model="m", prompts=prompts, wait=True)
        opened = audit.events()
    finally:
        audit.close()
    assert reply["ok"], reply
    assert reply["files"] == 12 and reply["accepted"] == 12
    assert reply["outcomes"]["read"] == len(written)
    assert reply["outcomes"]["missing"] == 2
    assert {p for p in opened if p.suffix == ".bin"} == set(written)
    assert not [p for p in opened if p.name.endswith(".tmp")]


def test_prefetch_blocks_accepts_block_hashes_and_inline_profiles(daemon: Daemon) -> None:
    layout = layout_for(daemon.root)
    hashes = [bytes([i]) * 32 for i in range(4)]
    reply = daemon.call("prefetch_blocks", hash=HASH, layout=layout, block_hashes=[hashes])
    assert reply["ok"] and reply["files"] == 4 and reply["accepted"] == 4, reply  # 2 files x 2


def test_stale_fingerprint_is_detected_and_named(daemon_factory: Any, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    config = write_config(tmp_path, root, "aaaaaaaaaaaa", streak=8)
    d: Daemon = daemon_factory("--config", str(config), root=root)
    (root / "org_model_bbbbbbbbbbbb_r0").mkdir()  # what the connector really writes
    for seed in range(4):
        prompt = {"token_ids": list(range(seed * 1000, seed * 1000 + 64))}
        reply = d.call("prefetch_blocks", model="m", prompts=[prompt], wait=True)
        assert reply["outcomes"]["missing"] == reply["accepted"] == 4
    # The scan for the likely fingerprint runs in the scout, off the loop: its answer
    # lands a moment after the streak that asked for it.
    deadline = time.monotonic() + 10
    stale = d.call("stats")["stats"]["kv"]["stale"]["m"]
    while not stale["stale"] and time.monotonic() < deadline:
        time.sleep(0.05)
        stale = d.call("stats")["stats"]["kv"]["stale"]["m"]
    assert stale["stale"] and stale["likely_fingerprint"] == "bbbbbbbbbbbb", stale
    deadline = time.monotonic() + 5
    while "bbbbbbbbbbbb" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "likely bbbbbbbbbbbb" in d.log()


def test_discover_finds_the_fingerprint_on_disk(daemon: Daemon) -> None:
    (daemon.root / "org_model_cccccccccccc_r0").mkdir()
    layout = {**layout_for(daemon.root), "fingerprint": "discover"}
    reply = daemon.call("resolve", hash=HASH, layout=layout,
                        prompts=[{"token_ids": list(range(32))}])
    assert reply["ok"] and reply["fingerprint"] == "cccccccccccc", reply
    (daemon.root / "org_model_dddddddddddd_r0").mkdir()
    ambiguous = daemon.call("resolve", hash=HASH, layout=layout,
                            prompts=[{"token_ids": list(range(32))}])
    # The first answer is remembered for a while; a new daemon would refuse the ambiguity.
    assert ambiguous["ok"] and ambiguous["fingerprint"] == "cccccccccccc"


@pytest.mark.parametrize("bad", ["tp_size = 0", 'root_dir = "/elsewhere"'])
def test_bad_model_profiles_stop_the_daemon_with_the_key(tmp_path: Path, bad: str) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    config = write_config(tmp_path, root, "0123456789ab")
    text = config.read_text()
    key = bad.split(" =")[0]
    text = "\n".join(line for line in text.splitlines() if not line.startswith(key + " "))
    config.write_text(text.replace("[models.m.layout]", f"[models.m.layout]\n{bad}"))
    result = subprocess.run(
        command("--config", str(config), "--root", str(root), "--socket", str(tmp_path / "s.sock")),
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 2 and f"models.m.layout.{key}" in result.stderr, result.stderr


def test_a_profile_may_warm_by_advice_while_the_daemon_reads(
    daemon_factory: Any, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    config = write_config(tmp_path, root, "0123456789ab")
    config.write_text(config.read_text().replace(
        "[models.m.hash]", '[models.m]\nwarm_mode = "advise"\n[models.m.hash]'))
    d: Daemon = daemon_factory("--config", str(config), "--warm-mode", "read", root=root)
    prompts = [{"token_ids": list(range(64))}]
    paths = [Path(p) for p in d.call("resolve", model="m", prompts=prompts)["paths"]]
    for path in paths:
        make_file(path, 256 * 1024)  # evicted, verified
    since = drops()
    reply = d.call("prefetch_blocks", model="m", prompts=prompts, wait=True)
    assert reply["outcomes"]["read"] == len(paths) == 4, reply
    assert_warmed(paths, 256 * 1024, since=since)  # every page, or reclaimed since
    workers = d.call("stats")["stats"]["workers"]
    assert sum(w.get("batches_other_mode", 0) for w in workers) >= 1
    plain = make_file(root / "plain.bin", 4096)
    d.call("prefetch", paths=[str(plain)], wait=True)
    after = d.call("stats")["stats"]["workers"]
    assert sum(w.get("batches_other_mode", 0) for w in after) == sum(
        w.get("batches_other_mode", 0) for w in workers)


def test_a_bad_profile_warm_mode_names_its_key(tmp_path: Path) -> None:
    from kvprefetchd.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"models\.m\.warm_mode"):
        build_config({"models": {"m": {"warm_mode": "fast"}}}, {})
