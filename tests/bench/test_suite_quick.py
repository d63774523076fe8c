"""`bench/run --quick` end to end, as CI runs it: the results' shape and sanity, never speed.

The quick suite's figures are noise (tiny sets, one repetition, DONTNEED instead of
drop_caches); what must hold is that every scenario ran, every method either ran clean
or says why it was skipped, the arithmetic is consistent (bytes = files x head, ratios
of a reference to itself are 1, percentiles ordered, CDFs monotone), nothing was dropped
or lost, and the plots are real PNGs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
import suite
import warmup

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux page cache only")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    pytest.importorskip("kvprefetchd._native")
    out = tmp_path_factory.mktemp("bench-quick")
    done = subprocess.run([str(BENCH / "run"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"bench/run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "warm-up time" in done.stdout  # the one-screen summary was printed
    return json.loads((out / "results.json").read_text()), out


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_every_scenario_of_the_quick_file_ran(quick: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick
    spec = suite.load_scenarios(BENCH / "scenarios" / "quick.toml")
    expected = [f"warmup/{datasets.dataset(w['dataset']).name}/{state}"
                for w in spec["warmup"] for state in w["states"]] + ["ack", "load"]
    assert [s["name"] for s in results["scenarios"]] == expected
    assert results["suite"] == "quick" and results["seconds"] > 0
    assert results["machine"]["cpus"] >= 1


def test_warmup_scenarios_are_consistent(quick: tuple[dict[str, Any], Path]) -> None:
    results, out = quick
    for scenario in (s for s in results["scenarios"] if s["kind"] == "warmup"):
        name, settings, methods = scenario["name"], scenario["settings"], scenario["methods"]
        assert (out / scenario["raw"]).exists(), name
        files, head = settings["files"], settings["head_bytes"]
        assert settings["workers"] == [2, 1]
        for engine in warmup.ENGINES:
            if f"kvprefetchd-{engine}" not in methods:
                assert scenario["state"] == "cold" and "mixed" in name  # a subset by choice
        for method, m in methods.items():
            if m["status"].startswith("skipped: "):
                assert method not in ("none",) and not method.startswith("kvprefetchd-")
                continue
            assert m["status"] == "ok", (name, method, m["status"])
            assert m["files"] == files and m["bytes"] == files * head, (name, method)
            assert finite(m["consumer_s"]) and finite(m["total_s"]), (name, method)
            if method == "none":
                assert m["wall_s"] is None and m["ratio_to_fio"] is None
                continue
            assert finite(m["wall_s"]) and finite(m["gb_s"]) and finite(m["files_s"])
            assert m["wall_s_min"] <= m["wall_s"] <= m["wall_s_max"], (name, method)
            assert m["total_s"] >= m["wall_s"], (name, method)
            for key in ("ratio_to_fio", "ratio_to_vmtouch", "total_ratio_to_fio"):
                assert m[key] is None or finite(m[key]), (name, method, key)
            assert m["cached_bytes_per_file"] > 0, (name, method)
        for reference in ("fio", "vmtouch"):
            if methods.get(reference, {}).get("status") == "ok":
                assert methods[reference][f"ratio_to_{reference}"] == pytest.approx(1.0)
        daemon = [m for n, m in methods.items() if n.startswith("kvprefetchd-")]
        assert daemon and all(m["kind"] == "daemon" for m in daemon)
        if scenario["state"] == "warm":
            assert "resident" in scenario["what"]


def test_the_raw_daemon_runs_read_or_skip_every_file(quick: tuple[dict[str, Any], Path]) -> None:
    """Cold: every head read; warm: every head found resident (the skip), none dropped."""
    # (a run whose status is not "ok" already failed test_warmup_scenarios_are_consistent)
    results, out = quick
    for scenario in (s for s in results["scenarios"] if s["kind"] == "warmup"):
        raw = json.loads((out / scenario["raw"]).read_text())
        want = "read" if scenario["state"] == "cold" else "resident"
        for method, m in raw["methods"].items():
            if not method.startswith("kvprefetchd-"):
                continue
            for run in m["runs"]:
                assert run["prepared"], (scenario["name"], method)
                detail = run["detail"]
                assert detail["dropped"] == 0 and detail["rejected"] == 0
                counted = {k: v for k, v in detail["outcomes"].items() if v}
                files = raw["dataset"]["files"]
                if want == "read":
                    assert counted == {"read": files}, (scenario["name"], method, counted)
                else:  # the host's reclaimer may take a verified head before the request
                    assert set(counted) <= {"read", "resident"}, (method, counted)
                    assert sum(counted.values()) == files, (method, counted)
                    assert counted.get("read", 0) <= max(1, 0.03 * files), (method, counted)


def test_ack_latency_percentiles_are_ordered(quick: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick
    ack = next(s for s in results["scenarios"] if s["kind"] == "ack_latency")
    assert ack["dropped"] == 0
    for mode, per_mode in ack["results"].items():
        assert list(per_mode) == ["1", "100", "1000"], mode
        for per_client in per_mode.values():
            for figures in per_client.values():
                for target in ("daemon", "echo"):
                    p = figures[target]
                    assert 0 < p["p50_us"] <= p["p99_us"] <= p["p999_us"] <= p["max_us"]
                    cdf = p["cdf_us"]
                    assert [q for q, _ in cdf] == sorted(q for q, _ in cdf)
                    assert [us for _, us in cdf] == sorted(us for _, us in cdf)
                    assert cdf[-1] == [100, p["max_us"]] or cdf[-1][1] == \
                        pytest.approx(p["max_us"], abs=0.1)


def test_router_load_lost_nothing(quick: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick
    load = next(s for s in results["scenarios"] if s["kind"] == "router_load")
    settings = load["settings"]
    assert load["requests"] == settings["clients"] * settings["requests_per_client"]
    assert load["answered"] == load["requests"] and load["lost"] == 0 and not load["errors"]
    assert load["books_balance"] is True
    lat = load["latency"]
    assert lat["n"] == load["answered"]
    assert 0 < lat["p50_us"] <= lat["p99_us"] <= lat["p999_us"] <= lat["max_us"]
    assert finite(load["requests_per_s"])


def test_plots_and_summary_are_written(quick: tuple[dict[str, Any], Path]) -> None:
    results, out = quick
    assert results["plots"] == ["throughput.png", "latency_cdf.png"]
    for name in results["plots"]:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    summary = (out / "summary.md").read_text()
    assert summary.count("**Warm-up:") == sum(
        1 for s in results["scenarios"] if s["kind"] == "warmup")
    assert "**Ack latency**" in summary and "**Router-like load**" in summary
    assert not (out / "data").exists()  # the scratch datasets are removed


def test_a_scenario_file_with_an_unknown_key_is_refused_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[suite]\nreps = 1\n\n[[warmup]]\ndataset = "10x1MiB"\nhaed = "1MiB"\n')
    with pytest.raises(suite.ScenarioError, match=r"\[\[warmup\]\] #1 has unknown keys \['haed'\]"):
        suite.load_scenarios(bad)
    bad.write_text('[[warmup]]\ndataset = "ten files"\n')
    with pytest.raises(suite.ScenarioError, match="neither COUNTxSIZE"):
        suite.load_scenarios(bad)
    bad.write_text('[[warmup]]\ndataset = "10x1MiB"\nstates = ["tepid"]\n')
    with pytest.raises(suite.ScenarioError, match="unknown states"):
        suite.load_scenarios(bad)
