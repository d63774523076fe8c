"""The benchmarks run end to end on a tiny set and write results of the promised shape.

Shape and sanity only (every method present, times positive, byte counts exact,
ratios finite): never speed. Timing here would be noise: a 20 MiB set, one
repetition, caches evicted with DONTNEED and no settling, on a shared machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from warmup import ENGINES, all_methods, chosen_methods

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
FILES, HEAD = 20, 1 << 20

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux page cache only")


def run(script: str, *args: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr[-3000:]}"


def warmup_args(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    """Tiny and quick: DONTNEED instead of drop_caches (no root needed, nobody else's cache
    dropped), no settle, no waiting for a quiet disk, no re-runs."""
    return ["--dataset", f"{FILES}x1MiB", "--base", str(tmp_path / "data"), "--reps", "1",
            "--cold", "fadvise", "--settle", "0", "--quiet-wait", "0", "--retries", "0",
            "--residency-sample", "0", "--out", str(out), *extra]


def finite_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and math.isfinite(value))


def test_warmup_results_have_every_method_and_sane_figures(tmp_path: Path) -> None:
    pytest.importorskip("kvprefetchd._native")
    out = tmp_path / "warmup"
    run("warmup.py", *warmup_args(tmp_path, out))
    results = json.loads((out / "results.json").read_text())

    methods = results["methods"]
    assert list(methods) == chosen_methods(all_methods(ENGINES), "all")  # fio-direct: by name
    assert results["dataset"]["files"] == FILES and results["head_bytes"] == HEAD
    assert len(results["orders"]) == 1

    ran = {name: m for name, m in methods.items() if not m["status"].startswith("skipped: ")}
    assert "none" in ran and all(f"kvprefetchd-{e}" in ran for e in ENGINES)
    for name, m in ran.items():
        assert m["status"] == "ok", (name, m["status"], [r["detail"] for r in m["runs"]])
        assert m["files"] == FILES and m["bytes"] == FILES * HEAD, name
        assert len(m["reps_s"]) == 1 and len(m["runs"]) == 1, name
        assert m["consumer"]["median_s"] > 0 and m["total"]["median_s"] > 0, name
        run_ = m["runs"][0]
        assert run_["cold"], f"{name}: the set was not cold before it"
        if name == "none":
            assert m["median_s"] is None and m["ratio_to_fio"] is None
            continue
        assert m["median_s"] > 0 and m["gb_s"] > 0 and m["files_s"] > 0, name
        for key in ("ratio_to_fio", "ratio_to_fio_runtime", "ratio_to_vmtouch"):
            assert finite_or_none(m[key]), (name, key, m[key])
        assert finite_or_none(m["total"]["ratio_to_none"]), name
        # Every method leaves the whole head in the page cache right after its warm-up
        # (but for the pages the host's reclaimer took back since: their shadow entries
        # count them), unless someone else dropped caches meanwhile (the run says so).
        if not run_["interference"]:
            got = run_["resident"]
            assert got["head_bytes_per_file"] + got["head_reclaimed_bytes_per_file"] == HEAD, \
                (name, got)
            assert got["whole_file_bytes_per_file"] + \
                got["whole_file_reclaimed_bytes_per_file"] >= HEAD, (name, got)
        assert m["cpu"]["median_s"] is not None and m["cpu"]["median_s"] >= 0, name
    for name in ("fio", "vmtouch"):
        if name in ran:
            assert ran[name]["ratio_to_" + name] == pytest.approx(1.0)
    for e in ENGINES:
        detail = ran[f"kvprefetchd-{e}"]["runs"][0]["detail"]
        assert detail["outcomes"]["read"] == FILES and detail["dropped"] == 0
        assert detail["bytes_read"] == FILES * HEAD


def test_warmup_says_why_a_missing_tool_is_skipped(tmp_path: Path) -> None:
    pytest.importorskip("kvprefetchd._native")
    empty = tmp_path / "bin"
    empty.mkdir()
    out = tmp_path / "skips"
    env = {**os.environ, "PATH": str(empty)}
    run("warmup.py", *warmup_args(tmp_path, out, "--methods", "fio,vmtouch,uring_heads,none"),
        env=env)
    methods = json.loads((out / "results.json").read_text())["methods"]
    assert methods["fio"]["status"] == "skipped: fio not found on PATH"
    assert methods["vmtouch"]["status"] == "skipped: vmtouch not found on PATH"
    assert methods["uring_heads"]["status"].startswith("skipped: ")
    assert methods["none"]["status"] == "ok"
    assert methods["none"]["total"]["ratio_to_fio"] is None


def test_ack_latency_results_have_every_size_and_ordered_percentiles(tmp_path: Path) -> None:
    pytest.importorskip("kvprefetchd._native")
    out = tmp_path / "ack"
    run("ack_latency.py", "--out", str(out), "--base", str(tmp_path), "--requests", "20,10,5",
        "--warmup", "2", "--blocks", "1")
    results = json.loads((out / "results.json").read_text())
    assert results["daemon"]["dropped"] == 0
    assert list(results["modes"]) == ["busy", "idle"]
    assert results["clients"][0] == "raw"
    for mode, per_mode in results["modes"].items():
        assert list(per_mode["sizes"]) == ["1", "100", "1000"], mode
        for size, entry in per_mode["sizes"].items():
            for client in results["clients"]:
                for target in ("daemon", "echo"):
                    p = entry[client][target]
                    assert p["n"] == entry["requests"], (mode, size, client, target)
                    assert 0 < p["p50_us"] <= p["p99_us"] <= p["p999_us"] <= p["max_us"]
                ratios = entry[client]["ratio_daemon_to_echo"]
                assert all(math.isfinite(v) and v > 0 for v in ratios.values()), (size, client)
