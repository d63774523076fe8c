"""The router PR #1156 prefetch plugin's behaviour vectors, run through the real daemon.

tests/vectors/prefetch_plugin_behaviour.json records what the plugin did, executed:
- residency_cases: its skip rule on real files made with a written head and a sparse
  tail (allocated = st_blocks * 512; size <= buffer: resident iff allocated >= size;
  else resident iff allocated > buffer). The daemon's `tier` residency rule is the
  same rule (native/prefetch.c tier_resident), so a root configured with
  `residency_by_root = { root = "tier" }` must settle each case as the plugin decided.
- submit_cases: non-blocking submission to a bounded queue with no consumer. The
  daemon's counterpart is a worker's queue_limit with the worker stopped: what fits
  is accepted, the rest dropped, and the ack comes at once either way.
(The pure parts, config defaulting, are in tests/kv/test_vectors_layout.py.)
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kv_vectors import vector
from kvharness.daemon import Daemon, start_config, write_config
from kvharness.files import make_file

BEHAVIOUR = vector("prefetch_plugin_behaviour.json")
RESIDENCY_CASES = BEHAVIOUR["residency_cases"]
SUBMIT_CASES = BEHAVIOUR["submit_cases"]
# The plugin's decision -> the daemon's outcome for the file.
OUTCOME_OF = {"skip_missing": "missing", "skip_resident": "resident", "read": "read"}


def plugin_decision(size: int, allocated: int, buffer: int) -> str:
    """The vector's `residency_rule`, applied to a file as this file system stores it."""
    resident = allocated >= size if size <= buffer else allocated > buffer
    return "skip_resident" if resident else "read"


@pytest.fixture(scope="module")
def tier_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose only root answers residency by the storage-tier rule."""
    workdir = tmp_path_factory.mktemp("tier")
    root = workdir / "kv"
    root.mkdir()
    daemon = start_config(workdir, {"roots": [str(root)], "workers": 2,
                                    "residency_by_root": {str(root): "tier"}})
    yield daemon
    daemon.kill()


@pytest.mark.parametrize("case", RESIDENCY_CASES, ids=lambda c: c["file"]["name"])
def test_the_tier_rule_decides_as_the_plugin_did(tier_daemon: Daemon, case: dict[str, Any]
                                                 ) -> None:
    spec = case["file"]
    path = tier_daemon.root / spec["name"]
    if not spec["missing"]:
        # The head written, the tail a hole: st_blocks counts the written head only.
        make_file(path, spec["size"], written=spec["written_head"])
        # st_blocks is file-system dependent (the vector's are ext4's); the case only
        # holds where this machine's file system leads the rule to the same decision.
        allocated = os.stat(path).st_blocks * 512
        decided = plugin_decision(spec["size"], allocated, spec["buffer_size"])
        assert decided == case["expected_decision"], (
            f"{spec['name']}: {allocated} bytes allocated here, "
            f"{case['observed_stat']['allocated_bytes_st_blocks_x512']} in the vector")
    reply = tier_daemon.call("prefetch", paths=[str(path)], wait=True,
                             read_bytes=spec["buffer_size"], timeout_ms=60_000)
    assert reply["ok"] and reply["accepted"] == 1, reply
    settled = {name: n for name, n in reply["outcomes"].items() if n}
    assert settled == {OUTCOME_OF[case["expected_decision"]]: 1}, (spec, reply)


@pytest.mark.parametrize("case", SUBMIT_CASES,
                         ids=lambda c: f"capacity{c['queue_capacity']}-prefilled{c['prefilled']}")
def test_a_full_queue_drops_at_once_as_the_plugin_skipped(
    daemon_factory: Any, tmp_path: Path, case: dict[str, Any]
) -> None:
    config = write_config(tmp_path / "queue.toml", {"queue_limit": case["queue_capacity"]})
    d: Daemon = daemon_factory("--config", str(config), "--workers", "1")
    (pid,) = d.worker_pids()
    os.kill(pid, signal.SIGSTOP)  # no consumer: nothing leaves the queue
    try:
        if case["prefilled"]:
            prefill = [str(d.root / f"prefill-{i}.bin") for i in range(case["prefilled"])]
            assert d.call("prefetch", paths=prefill)["accepted"] == case["prefilled"]
        paths = [str(d.root / f"p{i}.bin") for i in range(case["paths"])]
        reply = d.call("prefetch", paths=paths)  # answered while the worker is stopped
        assert (reply["accepted"], reply["dropped"]) == (case["submitted"], case["skipped"])
        depth = d.call("stats")["stats"]["workers"][0]["queue_depth"]
        assert depth == case["prefilled"] + case["submitted"] == min(
            case["queue_capacity"], case["prefilled"] + case["paths"])
    finally:
        os.kill(pid, signal.SIGCONT)
