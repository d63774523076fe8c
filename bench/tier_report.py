"""The slow tier in the suite's report: its results.json entry, Markdown and one-screen tables.

results.json keeps per point and method what an operator compares (wall time, files/s, the
tier's fetches and peak in flight, paired ratios to the best pool, fio and the ideal) and
drops the runs, which stay in raw/tier-*.json; the targets and the simulator's ceiling go
beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
from tier_summary import TARGET_HEAD, sweep_rows, target_rows


def scenario(label: str, raw: dict[str, Any], raw_path: Path) -> dict[str, Any]:
    points = [{**point, "methods": {name: {k: v for k, v in m.items() if k != "runs"}
                                    for name, m in point["methods"].items()}}
              for point in raw["points"]]
    dataset = raw["dataset"]
    return {
        "name": label,
        "kind": "tier",
        "status": "ok",
        "what": "warm-up of every file's head through the slow-tier simulator (bench/tiersim), "
                "made cold (evict-all) before each method; per latency point",
        "settings": {
            "dataset": dataset["name"], "files": dataset["files"],
            "file_bytes": dataset["file_bytes"], "head_bytes": raw["head_bytes"],
            "reps": raw["reps"], "workers": raw["workers"], "fio_depth": raw["fio_depth"],
            "run_budget_s": raw["run_budget_s"], **raw["tier"],
        },
        "daemons": raw["daemons"],
        "raw": str(raw_path),
        "seconds": raw["seconds"],
        "simulator_ceiling": raw["simulator_ceiling"],
        "points": points,
        "targets": raw["targets"],
    }


def skipped(label: str, reason: str) -> dict[str, Any]:
    """FUSE cannot be used here (and KVPREFETCH_REQUIRE_FUSE is not set): said, not run."""
    return {"name": label, "kind": "tier", "status": f"skipped: {reason}", "points": [],
            "targets": []}


def ok(entry: dict[str, Any]) -> bool:
    """Skipped with a reason, or every method ran clean (or was skipped with a reason)."""
    return entry["status"].startswith("skipped") or all(
        m["status"].startswith(("ok", "skipped"))
        for point in entry["points"] for m in point["methods"].values())


def title(entry: dict[str, Any]) -> str:
    s = entry["settings"]
    slots = f"{s['slots']} fetch slots" if s["slots"] else "unlimited fetch slots"
    return (f"{s['dataset']}, head {datasets.format_size(s['head_bytes'])}, chunk "
            f"{datasets.format_size(s['chunk_bytes'])}, {slots}, jitter {s['jitter_ms']:g} ms, "
            f"{s['reps']} reps, daemon workers {s['workers']}")


def floors(entry: dict[str, Any]) -> str:
    return ", ".join(f"{p['latency_ms']:g} ms: {p['simulator_floor_s']:.2f} s"
                     for p in entry["points"])


def markdown(entry: dict[str, Any], md_table: Callable[[list[str], list[list[str]]], str]
             ) -> str:
    """The scenario's section of summary.md; md_table: the report's table formatter."""
    if entry["status"].startswith("skipped"):
        return f"**Slow tier: {entry['name']}**: {entry['status']}"
    head, rows = sweep_rows(entry["points"])
    lines = [f"**Slow tier: {title(entry)}**", "",
             "Median warm-up s (x the best of the 64/256/1,024-thread pools, or x files x "
             "latency / slots on a slot-capped tier), then the peak of fetches in flight.", "",
             md_table(head, rows), "",
             f"The simulator's own floor, estimated from its ceiling ({floors(entry)}): "
             f"{entry['simulator_ceiling']['note']}; see "
             f"{entry['simulator_ceiling']['source']}."]
    if entry["targets"]:
        lines += ["", md_table(TARGET_HEAD, target_rows(entry["targets"]))]
    return "\n".join(lines)


def print_tables(console: Any, entry: dict[str, Any]) -> None:
    """The sweep and the targets, as the one-screen summary shows them (rich)."""
    from rich.table import Table

    if entry["status"].startswith("skipped"):
        console.print(f"slow tier {entry['name']}: {entry['status']}")
        return
    head, rows = sweep_rows(entry["points"])
    table = Table(title=f"slow tier: {title(entry)}\nmedian s (x best pool / x ideal) "
                  "peak in flight", title_justify="left")
    for index, column in enumerate(head):
        table.add_column(column, justify="right" if index else "left")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if entry["targets"]:
        targets = Table(title="issue 13 targets (kvprefetchd-auto)", title_justify="left")
        for column in TARGET_HEAD:
            targets.add_column(column)
        for row in target_rows(entry["targets"]):
            targets.add_row(*row)
        console.print(targets)
