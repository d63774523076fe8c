"""The benchmark suite behind `bench/run`: declarative scenarios, one results.json, plots.

A scenario file (bench/scenarios/quick.toml, full.toml, or your own with --scenarios)
lists what to run, fio-style: [suite] settings shared by every warm-up, one [[warmup]]
table per dataset (each in the states it names: `cold`, verified cold before every
method, or `warm`, heads verified resident: how fast is the skip), [[tier]] tables for the
same warm-up on a slow tier (bench/tiersim: a latency sweep, fetch slots; tier.py), [ack]
for the request path's acknowledgement latency against a msgpack echo floor, and [load]
for a router-like load of many small requests from several clients at once.

The suite runs the scenarios through the single-purpose scripts beside it (warmup.py,
tier.py, ack_latency.py, load.py; each also runs alone), shows a progress bar, and writes to --out:

  results.json        per scenario: settings, files, bytes, median wall time, GB/s,
                      files/s, consumer read and warm-up + consumer, latency percentiles,
                      and ratios to fio and to vmtouch measured in the same run
  raw/*.json          each script's own full results (every repetition, every check)
  throughput.png      warm-up and warm-up + consumer throughput per method and dataset
  latency_cdf.png     ack latency CDFs: daemon against the echo floor; router load
  tier_latency.png    warm-up time on the slow tier against its latency, per method
  summary.md          the summary tables in Markdown (what the README quotes)

    bench/run --quick --out /tmp/bench-quick      # < 2 min, what CI runs
    bench/run --full --out bench/out/full          # the figures to quote
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ack_latency
import datasets
import hot
import plots
import psutil
import realtier
import report
import tier
import tier_report
import warmup

import tiersim
from kvharness.realtier import RealTierUnavailable
from kvharness.realtier import required as realtier_required

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "scenarios"
SUITE_KEYS = {"reps", "cold", "settle", "quiet_wait", "retries", "residency_sample", "engines",
              "workers"}
WARMUP_KEYS = {"dataset", "head", "states", "methods", "reps"}
ACK_KEYS = {"sizes", "requests", "warmup", "blocks", "modes", "clients", "engine", "workers"}
LOAD_KEYS = {"clients", "requests_per_client", "engine", "workers"}
STATES = ("cold", "warm")


class ScenarioError(ValueError):
    """A scenario file that names an unknown key or value: refused before anything runs."""


def load_scenarios(path: Path) -> dict[str, Any]:
    """Read and check a scenario file; every error names the table and key."""
    with open(path, "rb") as handle:
        spec = tomllib.load(handle)
    unknown = set(spec) - {"suite", "warmup", "tier", "ack", "load", "hot", "realtier"}
    if unknown:
        raise ScenarioError(f"{path}: unknown tables {sorted(unknown)}")
    for table, keys in (("suite", SUITE_KEYS), ("ack", ACK_KEYS), ("load", LOAD_KEYS)):
        if extra := set(spec.get(table, {})) - keys:
            raise ScenarioError(f"{path}: [{table}] has unknown keys {sorted(extra)}")
    if extra := set(spec.get("hot", {})) - hot.HOT_KEYS:
        raise ScenarioError(f"{path}: [hot] has unknown keys {sorted(extra)}")
    for index, entry in enumerate(spec.get("warmup", [])):
        where = f"{path}: [[warmup]] #{index + 1}"
        if extra := set(entry) - WARMUP_KEYS:
            raise ScenarioError(f"{where} has unknown keys {sorted(extra)}")
        if "dataset" not in entry:
            raise ScenarioError(f"{where} needs a dataset")
        try:
            datasets.dataset(entry["dataset"])
        except ValueError as error:
            raise ScenarioError(f"{where}: {error}") from None
        if bad := set(entry.get("states", ["cold"])) - set(STATES):
            raise ScenarioError(f"{where}: unknown states {sorted(bad)}; use {STATES}")
    for index, entry in enumerate(spec.get("tier", [])):
        where = f"{path}: [[tier]] #{index + 1}"
        if errors := tier.check_table(entry, spec.get("suite", {}).get("reps", 3)):
            raise ScenarioError(f"{where}: {'; '.join(errors)}")
    for index, entry in enumerate(spec.get("realtier", [])):
        where = f"{path}: [[realtier]] #{index + 1}"
        if errors := realtier.check_table(entry, spec.get("suite", {}).get("reps", 2)):
            raise ScenarioError(f"{where}: {'; '.join(errors)}")
    return spec


def warmup_argv(suite: dict[str, Any], entry: dict[str, Any], state: str, base: Path,
                out: Path) -> list[str]:
    """The warmup.py command line of one (dataset, state): the suite's settings, overridable."""
    methods = entry.get("methods", "all")
    return [
        "--dataset", entry["dataset"], "--head", entry.get("head", "1MiB"),
        "--state", state, "--base", str(base), "--out", str(out), "--quiet",
        "--reps", str(entry.get("reps", suite.get("reps", 3))),
        "--cold", suite.get("cold", "auto"),
        "--settle", str(suite.get("settle", 4.0)),
        "--quiet-wait", str(suite.get("quiet_wait", 30.0)),
        "--retries", str(suite.get("retries", 2)),
        "--residency-sample", str(suite.get("residency_sample", 1000)),
        "--engines", ",".join(suite.get("engines", warmup.ENGINES)),
        "--workers", ",".join(str(w) for w in suite.get("workers", [2])),
        "--methods", methods if isinstance(methods, str) else ",".join(methods),
    ]


def planned_methods(args: argparse.Namespace) -> list[str]:
    """The methods warmup.run will try for these args (before skips): the progress total."""
    engines = [e for e in args.engines.split(",") if e]
    known = warmup.all_methods(engines, [int(w) for w in args.workers.split(",")])
    return warmup.chosen_methods(known, args.methods)


def ack_argv(ack: dict[str, Any], base: Path, out: Path) -> list[str]:
    return [
        "--out", str(out), "--base", str(base),
        "--sizes", ",".join(str(s) for s in ack.get("sizes", [1, 100, 1000])),
        "--requests", ",".join(str(r) for r in ack.get("requests", [2000, 1000, 1000])),
        "--warmup", str(ack.get("warmup", 20)), "--blocks", str(ack.get("blocks", 5)),
        "--modes", ",".join(ack.get("modes", ["busy", "idle"])),
        "--clients", ",".join(ack.get("clients", ["raw", "kvprefetch"])),
        "--engine", ack.get("engine", "io_uring"), "--workers", str(ack.get("workers", 2)),
    ]


def load_argv(spec: dict[str, Any], base: Path, out: Path) -> list[str]:
    return [
        "--out", str(out), "--base", str(base), "--quiet",
        "--clients", str(spec.get("clients", 8)),
        "--requests-per-client", str(spec.get("requests_per_client", 10_000)),
        "--engine", spec.get("engine", "pread"), "--workers", str(spec.get("workers", 2)),
    ]


class Progress:
    """A rich progress bar on a terminal; elsewhere (CI, nohup, a pipe) one line per step,
    which a log keeps and a live bar would not."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self._bar: Any = None
        self._task: Any = None
        if not sys.stderr.isatty():
            return
        try:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress
        except ImportError:
            return
        from rich.console import Console

        self._bar = RichProgress(TextColumn("[bold]{task.description:<40}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), console=Console(stderr=True),
                                 transient=False)

    @contextmanager
    def running(self) -> Iterator[Progress]:
        if self._bar is None:
            yield self
            return
        with self._bar:
            self._task = self._bar.add_task("starting", total=self.total)
            yield self

    def step(self, description: str, advance: int = 1) -> None:
        self.done += advance
        if self._bar is not None:
            self._bar.update(self._task, advance=advance, description=description)
        elif advance:
            stamp = time.strftime("%H:%M:%S")
            print(f"{stamp} [{self.done}/{self.total}] {description}", file=sys.stderr,
                  flush=True)

    def finish_phase(self, target: int, description: str) -> None:
        """Skipped methods never report: move to where this phase was planned to end."""
        if target > self.done:
            self.step(description, target - self.done)


def machine() -> dict[str, Any]:
    disk = Path("/sys/block")
    return {
        "kernel": platform.release(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "mem_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "loadavg_at_start": os.getloadavg(), "euid": os.geteuid(),
        "disks": sorted(p.name for p in disk.iterdir() if not p.name.startswith(("loop", "ram")))
        if disk.exists() else [],
        "tools": {name: shutil.which(name) is not None for name in ("fio", "vmtouch", "gcc")},
    }


def run_suite(spec: dict[str, Any], name: str, base: Path, out: Path,
              only: Sequence[str] = ()) -> dict[str, Any]:
    """Run every scenario of spec (or those whose kind is in only); the results."""
    suite = spec.get("suite", {})
    raw_dir = out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    plans: list[tuple[str, Callable[[Progress], dict[str, Any]], int]] = []

    def want(kind: str) -> bool:
        return not only or kind in only

    for entry in spec.get("warmup", []) if want("warmup") else []:
        for state in entry.get("states", ["cold"]):
            argv = warmup_argv(suite, entry, state, base, raw_dir / "tmp")
            args = warmup.parse_args(argv)
            label = f"warmup/{datasets.dataset(entry['dataset']).name}/{state}"
            units = args.reps * len(planned_methods(args))
            plans.append((label, _warmup_runner(label, args, raw_dir), units))
    for entry in spec.get("tier", []) if want("tier") else []:
        args = tier.parse_args(tier.table_argv(entry, suite.get("reps", 3), base,
                                               raw_dir / "tmp"))
        units = args.reps * len(tier.latencies(args)) * len(tier.method_list(args))
        label = tier.table_label(entry)
        plans.append((label, _tier_runner(label, args, raw_dir), units))
    for entry in spec.get("realtier", []) if want("realtier") else []:
        args = realtier.parse_args(realtier.table_argv(entry, suite.get("reps", 2),
                                                       raw_dir / "tmp"))
        units = args.reps * len(realtier.parse_tiers(args.tiers)) * len(
            [m for m in args.methods.split(",") if m])
        label = realtier.table_label(entry)
        plans.append((label, _realtier_runner(label, args, raw_dir), units))
    if "ack" in spec and want("ack"):
        args = ack_latency.parse_args(ack_argv(spec["ack"], base, raw_dir / "tmp"))
        units = len(args.modes.split(",")) * len(args.sizes.split(","))
        plans.append(("ack", _ack_runner(args, raw_dir), units))
    if "hot" in spec and want("hot"):
        args = hot.parse_args(hot.argv_of(spec["hot"], base, raw_dir / "tmp" / "hot"))
        plans.append(("hot", _hot_runner(args, raw_dir), 2 * len(hot.RULES)))
    if "load" in spec and want("load"):
        import load

        args = load.parse_args(load_argv(spec["load"], base, raw_dir / "tmp"))
        plans.append(("load", _load_runner(args, raw_dir), 1))

    started = time.time()
    progress = Progress(sum(units for _, _, units in plans))
    scenarios: list[dict[str, Any]] = []
    with progress.running():
        for label, runner, units in plans:
            target = progress.done + units
            progress.step(f"{label}: starting", 0)
            scenarios.append(runner(progress))
            progress.finish_phase(target, f"{label}: done")
    shutil.rmtree(raw_dir / "tmp", ignore_errors=True)
    results = {
        "suite": name,
        "version": 1,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "machine": machine(),
        "settings": suite,
        "argv": sys.argv,
        "ratios": "paired: the median over repetitions of method/reference measured in the "
                  "same repetition; below 1 is faster than the reference",
        "scenarios": scenarios,
    }
    return results


def _warmup_runner(label: str, args: argparse.Namespace,
                   raw_dir: Path) -> Callable[[Progress], dict[str, Any]]:
    def run(progress: Progress) -> dict[str, Any]:
        def on_run(method: str, rep: int, one: dict[str, Any]) -> None:
            progress.step(f"{label}: {method} #{rep + 1}")

        raw = warmup.run(args, on_run)
        path = raw_dir / (label.replace("/", "-") + ".json")
        path.write_text(json.dumps(raw, indent=1) + "\n")
        return report.warmup_scenario(label, raw, path.relative_to(raw_dir.parent))
    return run


def _tier_runner(label: str, args: argparse.Namespace,
                 raw_dir: Path) -> Callable[[Progress], dict[str, Any]]:
    def run(progress: Progress) -> dict[str, Any]:
        try:
            raw = tier.run(args, lambda latency, method, rep: progress.step(
                f"{label}: {latency:g} ms {method} #{rep + 1}"))
        except tiersim.FuseUnavailable as error:
            if tiersim.fuse_required():  # CI: FUSE must work there
                raise
            return tier_report.skipped(label, str(error))
        path = raw_dir / (label.replace("/", "-") + ".json")
        path.write_text(json.dumps(raw, indent=1) + "\n")
        return tier_report.scenario(label, raw, path.relative_to(raw_dir.parent))
    return run


def _realtier_runner(label: str, args: argparse.Namespace,
                     raw_dir: Path) -> Callable[[Progress], dict[str, Any]]:
    def run(progress: Progress) -> dict[str, Any]:
        try:
            raw = realtier.run(args, lambda tier_name, method, rep: progress.step(
                f"{label}: {tier_name} {method} #{rep + 1}"))
        except RealTierUnavailable as error:
            if realtier_required():  # CI: the real tiers must mount there
                raise
            return {"name": label, "kind": "realtier", "status": f"skipped: {error}",
                    "tiers": []}
        path = raw_dir / (label.replace("/", "-") + ".json")
        path.write_text(json.dumps(raw, indent=1) + "\n")
        ok = all(m["ok"] for t in raw["tiers"] for m in t["methods"].values())
        return {**raw, "name": label, "status": "ok" if ok else "failed",
                "raw": str(path.relative_to(raw_dir.parent))}
    return run


def realtier_markdown(results: dict[str, Any]) -> str:
    """The [[realtier]] scenarios' tables (report.markdown leaves kinds it does not know)."""
    parts = []
    for scenario in results["scenarios"]:
        if scenario["kind"] != "realtier":
            continue
        if scenario["tiers"]:
            parts.append(realtier.markdown(scenario))
        else:
            parts.append(f"**Real tiers**: {scenario['status']}")
    return "".join("\n" + part + "\n" for part in parts)


def _ack_runner(args: argparse.Namespace, raw_dir: Path) -> Callable[[Progress], dict[str, Any]]:
    def run(progress: Progress) -> dict[str, Any]:
        raw = ack_latency.run(args, lambda mode, size: progress.step(f"ack: {mode} {size}"))
        path = raw_dir / "ack.json"
        path.write_text(json.dumps(raw, indent=1) + "\n")
        return report.ack_scenario(raw, path.relative_to(raw_dir.parent))
    return run


def _hot_runner(args: argparse.Namespace, raw_dir: Path) -> Callable[[Progress], dict[str, Any]]:
    def run(progress: Progress) -> dict[str, Any]:
        args.out.mkdir(parents=True, exist_ok=True)
        raw = hot.run(args, progress.step)
        path = raw_dir / "hot.json"
        path.write_text(json.dumps(raw, indent=1) + "\n")
        return hot.scenario(raw, path.relative_to(raw_dir.parent))
    return run


def _load_runner(args: argparse.Namespace, raw_dir: Path) -> Callable[[Progress], dict[str, Any]]:
    def run(progress: Progress) -> dict[str, Any]:
        progress.step(f"load: {args.clients} clients x {args.requests_per_client}", 0)
        import load

        raw = load.run(args)
        path = raw_dir / "load.json"
        path.write_text(json.dumps(raw, indent=1) + "\n")
        progress.step("load: done")
        return report.load_scenario(raw, path.relative_to(raw_dir.parent))
    return run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/run", description=__doc__.split("\n\n")[0],
        epilog="Read bench/README.md for what each figure means and how to trust it.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--quick", action="store_true",
                       help="every scenario, tiny (< 2 min on 2 cores): what CI runs")
    which.add_argument("--full", action="store_true", help="the figures to quote")
    which.add_argument("--scenarios", type=Path, metavar="TOML", help="your own scenario file")
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--base", type=Path, default=None,
                        help="where datasets live (default: /var/tmp/kvbench for --full, "
                        "OUT/data otherwise, removed afterwards)")
    parser.add_argument("--only", default="",
                        help="comma list of kinds: warmup,tier,ack,load,hot,realtier")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every daemon the scenarios started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    name = "quick" if args.quick else "full" if args.full else args.scenarios.stem
    spec = load_scenarios(args.scenarios or SCENARIOS / f"{name}.toml")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.base is None and not args.full
    base = args.base or (datasets.DEFAULT_BASE if args.full else args.out / "data")
    try:
        results = run_suite(spec, name, base, args.out,
                            [k for k in args.only.split(",") if k])
    finally:
        if scratch:
            shutil.rmtree(base, ignore_errors=True)
    if not args.no_plots:
        results["plots"] = plots.draw(results, args.out)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "summary.md").write_text(report.markdown(results) + realtier_markdown(results))
    report.print_summary(results)
    if extra := realtier_markdown(results):
        print(extra)
    print(f"\nresults: {args.out / 'results.json'}", file=sys.stderr)
    realtier_ok = all(s["status"] != "failed" for s in results["scenarios"]
                      if s["kind"] == "realtier")
    return 0 if report.all_ok(results) and realtier_ok else 1


if __name__ == "__main__":
    sys.exit(main())
