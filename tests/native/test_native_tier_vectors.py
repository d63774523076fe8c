"""The storage-tier rule (native/residency.c) against the recorded behaviour of the router
plugin it replaces: tests/vectors/prefetch_plugin_behaviour.json, `residency_cases`.

Each case is made for real (its head written, the rest a hole, fsync'ed so the blocks are
allocated), then one batch under KVP_RES_TIER with read_bytes = the plugin's buffer must
decide as the plugin did: skip_missing -> MISSING, skip_resident -> RESIDENT, read -> READ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from native_helpers import Ctx, Result

from kvprefetchd._native import lib

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "prefetch_plugin_behaviour.json"
CASES: list[dict[str, Any]] = json.loads(VECTORS.read_text())["residency_cases"]


def make_case(root: Path, case: dict[str, Any]) -> None:
    spec = case["file"]
    if spec["missing"]:
        return
    with open(root / spec["name"], "wb") as f:
        f.write(os.urandom(spec["written_head"]))
        f.truncate(spec["size"])
        f.flush()
        os.fsync(f.fileno())
    allocated = os.stat(root / spec["name"]).st_blocks * 512
    if allocated != case["observed_stat"]["allocated_bytes_st_blocks_x512"]:
        pytest.skip(f"{spec['name']}: this file system allocates {allocated} bytes, the "
                    f"vector's {case['observed_stat']['allocated_bytes_st_blocks_x512']}")


def expected(case: dict[str, Any]) -> Result:
    spec = case["file"]
    span = min(spec["size"], spec["buffer_size"])
    return {
        "skip_missing": Result("MISSING", "ENOENT", 0, 0),
        "skip_resident": Result("RESIDENT", "", spec["size"], span),
        "read": Result("READ", "", spec["size"], span),
    }[case["expected_decision"]]


def test_the_vectors_cover_every_decision() -> None:
    assert {c["expected_decision"] for c in CASES} == {"skip_missing", "skip_resident", "read"}
    assert all(c["error"] is None for c in CASES)


def test_the_tier_rule_decides_as_the_plugin_did(engine: str, root) -> None:
    for case in CASES:
        make_case(root.path, case)
    buffers = [c["file"]["buffer_size"] for c in CASES]
    res = Ctx(engine).run(root.fd, [c["file"]["name"] for c in CASES], buffers,
                          residency=lib.KVP_RES_TIER)
    assert res == [expected(c) for c in CASES]
