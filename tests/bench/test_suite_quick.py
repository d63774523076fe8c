"""`bench/run --quick` end to end, as CI runs it: the results' shape and sanity, never speed.

The quick suite's figures are noise (tiny sets, one repetition, DONTNEED instead of
drop_caches); what must hold is that every scenario ran, every method either ran clean
or says why it was skipped, the arithmetic is consistent (bytes = files x head, ratios
of a reference to itself are 1, percentiles ordered, CDFs monotone), nothing was dropped
or lost, and the plots are real PNGs. The slow tier (bench/tiersim) runs where FUSE can
be used; elsewhere its scenario says why not, and with KVPREFETCH_REQUIRE_FUSE=1 (CI)
not being able to mount fails the run.
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
import tier
import tier_methods
import warmup

import tiersim

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
                for w in spec["warmup"] for state in w["states"]]
    expected += [tier.table_label(t) for t in spec["tier"]] + ["ack", "hot", "load"]
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
                else:  # every mlocked head resident; one mlock refused may have been taken
                    assert set(counted) <= {"read", "resident"}, (method, counted)
                    assert sum(counted.values()) == files, (method, counted)
                    assert counted.get("resident", 0) >= run["mlocked"], (method, counted)
                    if run["mlocked"] < files:
                        print(f"{method}: {files - run['mlocked']} heads not mlocked, "
                              f"{counted.get('read', 0)} read again")


def tier_scenarios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The slow tier's scenarios that ran; a skip (with its reason) where FUSE cannot be used."""
    scenarios = [s for s in results["scenarios"] if s["kind"] == "tier"]
    assert scenarios
    for scenario in scenarios:
        if scenario["status"].startswith("skipped: "):
            assert not tiersim.fuse_required(), scenario["status"]
            pytest.skip(f"slow tier: {scenario['status']}")
        assert scenario["status"] == "ok", scenario["status"]
    return scenarios


def test_tier_scenarios_have_every_method_and_sane_figures(
        quick: tuple[dict[str, Any], Path]) -> None:
    results, _ = quick
    for scenario in tier_scenarios(results):
        s = scenario["settings"]
        assert [p["latency_ms"] for p in scenario["points"]] == s["latencies_ms"]
        assert {d["residency"] for d in scenario["daemons"].values()} == {"tier"}
        assert scenario["daemons"]["kvprefetchd-auto"]["engine"] == "auto"
        for point in scenario["points"]:
            assert set(point["methods"]) == set(tier_methods.METHODS), list(point["methods"])
            for method, m in point["methods"].items():
                if m["status"].startswith("skipped: "):
                    assert method in ("fio", "vmtouch"), (method, m["status"])
                    continue
                assert m["status"] == "ok" and m["every_head_fetched"], (method, m)
                assert m["files"] == s["files"] and m["bytes"] == s["files"] * s["head_bytes"]
                if method == "none":
                    assert m["wall_s"] is None and m["fetches"] == [0] * s["reps"]
                    assert m["peak_in_flight"] == 0
                    continue
                assert finite(m["wall_s"]) and finite(m["files_s"]), method
                assert m["wall_s_min"] <= m["wall_s"] <= m["wall_s_max"], method
                assert finite(m["ratio_to_best_pool"]) and finite(m["ratio_to_fio"]), method
                assert m["peak_in_flight"] > 0, method  # the quick point's latency is > 0
                assert 0 < m["head_cached_fraction"] <= 1, method
            pools = [point["methods"][p]["ratio_to_best_pool"] for p in tier_methods.TARGET_POOLS]
            assert min(pools) == pytest.approx(1.0)  # the best pool is its own reference
        for target in scenario["targets"]:
            assert finite(target["ratio"]) and isinstance(target["met"], bool), target


def test_tier_runs_fetch_every_head_exactly_once(quick: tuple[dict[str, Any], Path]) -> None:
    """Per run, the simulator's fetches are the chunks the method had to bring (its heads,
    or whole files for vmtouch; none for `none`), each file's st_blocks covers them, and
    every daemon run read every file (the tier rule saw an evicted, block-less stub)."""
    results, out = quick
    for scenario in tier_scenarios(results):
        raw = json.loads((out / scenario["raw"]).read_text())
        files, size, head = raw["dataset"]["files"], raw["dataset"]["file_bytes"], raw["head_bytes"]
        chunk = raw["tier"]["chunk_bytes"]
        for point in raw["points"]:
            for method, m in point["methods"].items():
                for run in m.get("runs", []):
                    span = 0 if method == "none" else size if method == "vmtouch" else head
                    fetches = files * -(-min(span, size) // chunk)
                    assert run["tier"]["fetches"] == run["expected_fetches"] == fetches, \
                        (method, run["tier"])
                    assert run["files_fetched"] == (files if span else 0), method
                    assert run["tier"]["read_errors"] == 0 and run["tier"]["queued"] == 0
                    if method.startswith("kvprefetchd-"):
                        outcomes = {k: v for k, v in run["detail"]["outcomes"].items() if v}
                        assert outcomes == {"read": files}, (method, outcomes)


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


def test_the_hot_path_says_resident_for_a_resident_set_and_drops_nothing(
    quick: tuple[dict[str, Any], Path],
) -> None:
    """Figures, not speed: every rule ran both phases, a resident set came back resident
    (every head, mlocked for the run; where mlock is refused, at least the mlocked ones),
    nothing offered was dropped, and the CPU figures are finite and positive."""
    results, _ = quick
    entry = next(s for s in results["scenarios"] if s["kind"] == "hot")
    assert set(entry["rules"]) == {"pagecache", "tier"}
    for rule, figures in entry["rules"].items():
        wait, sustained = figures["wait"], figures["sustained"]
        assert sum(wait["outcomes"].values()) == wait["files"], (rule, wait)
        reps = wait["files"] // entry["files"]
        assert wait["outcomes"].get("resident", 0) >= reps * figures["mlocked"], (rule, wait)
        if figures["mlocked"] < entry["files"]:
            print(f"hot {rule}: {entry['files'] - figures['mlocked']} heads not mlocked")
        assert sustained["dropped"] == 0 and sustained["offered"] > 0, (rule, sustained)
        assert sustained["accepted"] == sustained["offered"] == sustained["settled"], sustained
        # CPU time comes in 10 ms ticks: a tiny run may count 0 for a process, never less
        for key in ("daemon_cpu_us_per_file", "supervisor_cpu_us_per_file"):
            for phase in (wait, sustained):
                assert math.isfinite(phase[key]) and phase[key] >= 0, (rule, key, phase)


def test_plots_and_summary_are_written(quick: tuple[dict[str, Any], Path]) -> None:
    results, out = quick
    ran_tier = any(s["kind"] == "tier" and s["points"] for s in results["scenarios"])
    assert results["plots"] == ["throughput.png", "latency_cdf.png",
                                *(["tier_latency.png"] if ran_tier else [])]
    for name in results["plots"]:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    summary = (out / "summary.md").read_text()
    assert summary.count("**Warm-up:") == sum(
        1 for s in results["scenarios"] if s["kind"] == "warmup")
    assert "**Ack latency**" in summary and "**Router-like load**" in summary
    assert "**Hot path**" in summary
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


def test_a_tier_table_with_a_bad_key_method_or_dataset_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    for body, error in (('latency = [20]', r"\[\[tier\]\] #1: unknown keys \['latency'\]"),
                        ('methods = ["kvprefetchd-turbo"]', "no engine 'turbo'"),
                        ('methods = ["pypool-0"]', "pypool-0: 1-4096"),
                        ('methods = ["cat"]', "cat: not a method"),
                        ('head = "1MiB"', "larger than the files")):
        bad.write_text(f'[[tier]]\ndataset = "10x512KiB"\n{body}\n')
        with pytest.raises(suite.ScenarioError, match=error):
            suite.load_scenarios(bad)
    bad.write_text('[[tier]]\ndataset = "mixed:10"\n')
    with pytest.raises(suite.ScenarioError, match="files of one size"):
        suite.load_scenarios(bad)
    bad.write_text('[[tier]]\ndataset = "10x512KiB"\nlatency_ms = 5\nmethods = "fio,none"\n')
    assert suite.load_scenarios(bad)["tier"][0]["latency_ms"] == 5
