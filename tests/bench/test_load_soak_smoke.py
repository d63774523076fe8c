"""bench/loadgen.py and bench/soak.py run end to end on a tiny set and write JSON of the
promised shape: shape only, never their numbers (a few thousand requests on a shared
machine measure nothing; the soak's 10^6 requests are a benchmark, not a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
LATENCY_KEYS = {"count", "p50", "p99", "p999", "max", "mean", "cdf"}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux only")


def run(script: str, *args: str) -> None:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr[-3000:]}"


def check_load_figures(figures: dict[str, Any], sent: int) -> None:
    assert figures["sent"] == figures["answered"] == sent and figures["lost"] == 0
    assert set(figures["files"]) == {"accepted", "dropped", "rejected"}
    assert set(figures["ack_ms"]) == LATENCY_KEYS
    assert set(figures["ack_ms_by_op"]) <= {"prefetch", "prefetch_blocks", "ping"}
    assert all(set(v) == LATENCY_KEYS for v in figures["ack_ms_by_op"].values())


def test_load_cli_writes_its_figures(tmp_path: Path) -> None:
    run("loadgen.py", "--clients", "2", "--requests", "300", "--dataset", "100x4KiB",
        "--base", str(tmp_path / "data"), "--out", str(tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "load.json").read_text())
    check_load_figures(result, 600)
    assert result["books"]["balanced"] is True
    assert {"dataset", "mix", "pipeline", "cpus"} <= set(result["setup"])


def test_soak_with_a_small_count_writes_samples_and_a_verdict(tmp_path: Path) -> None:
    run("soak.py", "--requests", "2000", "--clients", "2", "--interval", "0.2",
        "--dataset", "100x4KiB", "--base", str(tmp_path / "data"), "--out", str(tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert result["requests"] == 2000
    check_load_figures(result["load"], 2000)
    assert result["books"]["balanced"] is True and result["worker_restarts"] == 0
    assert result["samples"], "no sample taken while the clients ran"
    for sample in [*result["samples"], result["idle_before"], result["idle_after"]]:
        assert {"t", "requests", "connections", "in_flight", "processes"} <= set(sample)
        assert {"supervisor", "worker0", "worker1"} == set(sample["processes"])
        for figures in sample["processes"].values():
            assert set(figures) == {"pid", "rss_bytes", "open_fds"}
    steady = result["steady"]
    assert isinstance(steady["rss_flat"], bool) and isinstance(result["flat"], bool)
    assert set(result["idle_fds"]) == {"supervisor", "worker0", "worker1"}
    assert all(set(f) == {"before", "after", "returned"} for f in result["idle_fds"].values())
    assert set(steady["processes"]) == {"supervisor", "worker0", "worker1"}
    for entry in steady["processes"].values():
        assert {"pids", "replaced", "rss_bytes", "open_fds"} <= set(entry)
        for figure in ("rss_bytes", "open_fds"):
            assert {"first", "last", "min", "max", "slope_per_hour", "slope_per_100k_requests",
                    "change_pct", "drift_pct", "flat", "every_sample_within_5pct"} == set(
                        entry[figure])
