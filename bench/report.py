"""What the suite reports: compact per-scenario results, the summary tables, the verdict.

Each script's raw results keep every repetition and check (raw/*.json); the suite's
results.json keeps per scenario what an operator compares (fio-like: settings, files,
bytes, wall time, GB/s, files/s, latency percentiles, ratios to fio and vmtouch measured
in the same run). The same figures are printed as a one-screen summary and written as
Markdown for the README.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets
import hot
import tier_report

# What the one-screen summary shows of a warm-up (everything is in results.json).
SUMMARY_SKIP = ("uring_heads", "pypool-32")


def warmup_scenario(label: str, raw: dict[str, Any], raw_path: Path) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for name, m in raw["methods"].items():
        if m["status"].startswith("skipped"):
            methods[name] = {"status": m["status"]}
            continue
        reps = [s for s in m["reps_s"] if s is not None]
        total = m["total"]
        methods[name] = {
            "status": m["status"],
            "kind": m["kind"],
            "files": m["files"],
            "bytes": m["bytes"],
            "wall_s": m["median_s"],
            "wall_s_min": min(reps) if reps else None,
            "wall_s_max": max(reps) if reps else None,
            "gb_s": m["gb_s"],
            "files_s": m["files_s"],
            "us_per_file": m["median_s"] / m["files"] * 1e6 if m["median_s"] else None,
            "ratio_to_fio": m["ratio_to_fio"],
            "ratio_to_vmtouch": m["ratio_to_vmtouch"],
            "consumer_s": m["consumer"]["median_s"],
            "total_s": total["median_s"],
            "total_ratio_to_fio": total["ratio_to_fio"],
            "total_ratio_to_vmtouch": total["ratio_to_vmtouch"],
            "total_ratio_to_none": total["ratio_to_none"],
            "cached_bytes_per_file": m["resident"]["whole_file_bytes_per_file"],
            "head_resident_fraction": m["resident"]["head_bytes_per_file"]
            / m["resident"]["asked_per_file"],
            "cpu_s_per_gb": m["cpu"]["s_per_gb"],
            "disturbed_runs_kept": m["disturbed_runs_kept"],
            "runs_redone": m["runs_redone"],
        }
    dataset = raw["dataset"]
    return {
        "name": label,
        "kind": "warmup",
        "state": raw["state"],
        "what": "warm-up of every file's head on a set verified cold before each method"
        if raw["state"] == "cold" else "the same request on a set whose heads are verified "
        "resident: the cost of finding there is nothing to do",
        "settings": {
            "dataset": dataset["name"], "files": dataset["files"],
            "file_bytes": dataset["file_bytes"], "mixed": dataset.get("mixed", False),
            "head_bytes": raw["head_bytes"], "reps": raw["reps"],
            "workers": raw.get("worker_counts", [raw["workers"]]),
            "chunk_paths": raw["chunk_paths"], "client": raw["client"],
            "cold": raw["cold"]["method"], "settle_s": raw["cold"]["settle_s"],
        },
        "raw": str(raw_path),
        "seconds": raw["seconds"],
        "methods": methods,
    }


def _latency(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("n", "p50_us", "p99_us", "p999_us", "max_us", "cdf_us")}


def ack_scenario(raw: dict[str, Any], raw_path: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mode, per_mode in raw["modes"].items():
        for size, entry in per_mode["sizes"].items():
            for client in raw["clients"]:
                e = entry[client]
                results.setdefault(mode, {}).setdefault(size, {})[client] = {
                    "daemon": _latency(e["daemon"]), "echo": _latency(e["echo"]),
                    "ratio_daemon_to_echo": e["ratio_daemon_to_echo"],
                }
    return {
        "name": "ack",
        "kind": "ack_latency",
        "what": "send to reply of a fire-and-forget prefetch (no I/O waited for), closed loop, "
                "against a msgpack echo server on the same kind of socket (the floor)",
        "settings": {"engine": raw["daemon"]["engine"], "workers": raw["daemon"]["workers"],
                     "clients": raw["clients"], "modes": list(raw["modes"])},
        "raw": str(raw_path),
        "seconds": raw["seconds"],
        "dropped": raw["daemon"]["dropped"],
        "results": results,
    }


def load_scenario(raw: dict[str, Any], raw_path: Path) -> dict[str, Any]:
    return {
        "name": "load",
        "kind": "router_load",
        "what": raw.get("what", "many small concurrent requests from several clients"),
        "settings": raw["settings"],
        "raw": str(raw_path),
        "seconds": raw["seconds"],
        "requests": raw["requests"],
        "answered": raw["answered"],
        "lost": raw["lost"],
        "errors": raw["errors"],
        "requests_per_s": raw["requests_per_s"],
        "latency": _latency(raw["latency"]),
        "books_balance": raw["books_balance"],
    }


def all_ok(results: dict[str, Any]) -> bool:
    """Every method ran clean (or was skipped with a reason), nothing dropped or lost."""
    return all(scenario_ok(scenario) for scenario in results["scenarios"])


def scenario_ok(scenario: dict[str, Any]) -> bool:
    kind = scenario["kind"]
    if kind == "warmup":
        return all(m["status"].startswith(("ok", "skipped"))
                   for m in scenario["methods"].values())
    if kind == "tier":
        return tier_report.ok(scenario)
    if kind == "ack_latency":
        return not scenario["dropped"]
    if kind == "router_load":
        return not (scenario["lost"] or scenario["errors"] or not scenario["books_balance"])
    if kind == "hot":
        return hot.ok(scenario)
    return True


# ---- tables -------------------------------------------------------------------------------


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def warmup_rows(scenario: dict[str, Any], *, every: bool) -> Iterable[list[str]]:
    for name, m in scenario["methods"].items():
        if not every and name in SUMMARY_SKIP:
            continue
        if m["status"].startswith("skipped"):
            yield [name, m["status"], *[""] * 9]
            continue
        yield [
            name + ("" if m["status"] == "ok" else " (!)"),
            _f(m["wall_s"], ".3f"), _f(m["gb_s"], ".2f"), _f(m["us_per_file"], ".1f"),
            _f(m["ratio_to_fio"], ".2f"), _f(m["ratio_to_vmtouch"], ".2f"),
            _f(m["consumer_s"], ".3f"), _f(m["total_s"], ".3f"),
            _f(m["total_ratio_to_fio"], ".2f"), _f(m["total_ratio_to_none"], ".2f"),
            f"{m['cached_bytes_per_file'] / (1 << 20):.2f} MiB",
        ]


WARMUP_HEAD = ["method", "warm-up s", "GB/s", "µs/file", "x fio", "x vmtouch", "consumer s",
               "sum s", "sum x fio", "sum x none", "cached/file"]
ACK_HEAD = ["mode", "paths", "client", "p50 µs", "p99 µs", "p999 µs", "echo p50", "echo p99",
            "echo p999", "p99 x echo"]
LOAD_HEAD = ["clients x requests", "answered", "lost", "req/s", "p50 µs", "p99 µs", "p999 µs"]


def ack_rows(scenario: dict[str, Any]) -> Iterable[list[str]]:
    for mode, per_mode in scenario["results"].items():
        for size, per_client in per_mode.items():
            for client, r in per_client.items():
                d, e = r["daemon"], r["echo"]
                yield [mode, size, client, *(f"{d[k]:.0f}" for k in ("p50_us", "p99_us",
                                                                     "p999_us")),
                       *(f"{e[k]:.0f}" for k in ("p50_us", "p99_us", "p999_us")),
                       f"{r['ratio_daemon_to_echo']['p99_us']:.1f}"]


def load_row(scenario: dict[str, Any]) -> list[str]:
    s, lat = scenario["settings"], scenario["latency"]
    return [f"{s['clients']} x {s['requests_per_client']}", str(scenario["answered"]),
            str(scenario["lost"]), f"{scenario['requests_per_s']:.0f}",
            *(f"{lat[k]:.0f}" for k in ("p50_us", "p99_us", "p999_us"))]


def _title(scenario: dict[str, Any]) -> str:
    s = scenario["settings"]
    head = datasets.format_size(s["head_bytes"])
    state = f"made cold by {s['cold']}" if scenario["state"] == "cold" \
        else "heads verified resident first"
    return (f"{s['dataset']} ({scenario['state']}), {s['files']} files, head {head}, "
            f"{s['reps']} reps, daemon workers {s['workers']}, {state}")


def md_table(head: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
              for row in rows]
    return "\n".join(lines)


HEADLINE_HEAD = ["dataset", "state", "method", "warm-up s", "x fio", "x vmtouch", "sum x fio",
                 "sum x none"]
HEADLINE_METHODS = ("kvprefetchd-pread", "kvprefetchd-io_uring", "kvprefetchd-fadvise",
                    "pypool-16")


def headline_rows(results: dict[str, Any]) -> Iterable[list[str]]:
    """kvprefetchd's engines (and the seed's design) against fio and vmtouch, per dataset."""
    for scenario in results["scenarios"]:
        if scenario["kind"] != "warmup":
            continue
        s = scenario["settings"]
        for name in HEADLINE_METHODS:
            m = scenario["methods"].get(name)
            if m is None or m["status"].startswith("skipped"):
                continue
            yield [f"{s['dataset']}, head {datasets.format_size(s['head_bytes'])}",
                   scenario["state"], name + ("" if m["status"] == "ok" else " (!)"),
                   _f(m["wall_s"], ".3f"), _f(m["ratio_to_fio"], ".2f"),
                   _f(m["ratio_to_vmtouch"], ".2f"), _f(m["total_ratio_to_fio"], ".2f"),
                   _f(m["total_ratio_to_none"], ".2f")]


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    parts = [f"Suite `{results['suite']}`, {results['started']}, {results['seconds']:.0f} s; "
             f"Linux {m['kernel']}, {m['cpus']} CPUs, {m['mem_gib']} GiB. Times are medians; "
             "ratios are paired per repetition (below 1 is faster); `sum` is warm-up + the "
             "consumer's read of every head right after it."]
    if headline := list(headline_rows(results)):
        parts.append("**Headline**\n\n" + md_table(HEADLINE_HEAD, headline))
    for scenario in results["scenarios"]:
        if scenario["kind"] == "warmup":
            parts.append(f"**Warm-up: {_title(scenario)}**\n\n"
                         + md_table(WARMUP_HEAD, warmup_rows(scenario, every=True)))
        elif scenario["kind"] == "tier":
            parts.append(tier_report.markdown(scenario, md_table))
        elif scenario["kind"] == "ack_latency":
            parts.append(f"**Ack latency** ({scenario['settings']['engine']}, "
                         f"{scenario['settings']['workers']} workers; dropped "
                         f"{scenario['dropped']})\n\n" + md_table(ACK_HEAD,
                                                                    ack_rows(scenario)))
        elif scenario["kind"] == "hot":
            parts.append("\n".join(hot.summary(scenario)))
        elif scenario["kind"] == "router_load":
            parts.append("**Router-like load** (books balance: "
                         f"{scenario['books_balance']})\n\n"
                         + md_table(LOAD_HEAD, [load_row(scenario)]))
    return "\n\n".join(parts) + "\n"


def print_summary(results: dict[str, Any]) -> None:
    """One screen: warm-up time x fio / x vmtouch per method and scenario, acks, load."""
    from rich.console import Console
    from rich.table import Table

    # Piped (CI, a log file), rich assumes 80 columns and wraps every cell: allow a wide screen.
    console = Console(width=None if sys.stdout.isatty() else 160)
    warmups = [s for s in results["scenarios"] if s["kind"] == "warmup"]
    if warmups:
        table = Table(title="warm-up time: x fio / x vmtouch (sum with consumer read: x fio)",
                      title_justify="left")
        table.add_column("method")
        for s in warmups:
            table.add_column(f"{s['settings']['dataset']}\n{s['state']}", justify="right")
        names = [n for n in dict.fromkeys(n for s in warmups for n in s["methods"])
                 if n not in SUMMARY_SKIP]
        for name in names:
            cells = []
            for s in warmups:
                m = s["methods"].get(name)
                if m is None or m["status"].startswith("skipped"):
                    cells.append("-")
                elif name == "none":
                    cells.append(f"consumer {_f(m['consumer_s'], '.2f')} s")
                else:
                    bad = "" if m["status"] == "ok" else " (!)"
                    cells.append(f"{_f(m['ratio_to_fio'], '.2f')} / "
                                 f"{_f(m['ratio_to_vmtouch'], '.2f')} "
                                 f"({_f(m['total_ratio_to_fio'], '.2f')}){bad}")
            table.add_row(name, *cells)
        console.print(table)
    for s in results["scenarios"]:
        if s["kind"] == "tier":
            tier_report.print_tables(console, s)
        elif s["kind"] == "ack_latency":
            table = Table(title=f"ack latency (dropped {s['dropped']})", title_justify="left")
            for column in ACK_HEAD:
                table.add_column(column, justify="right")
            for row in ack_rows(s):
                table.add_row(*row)
            console.print(table)
        elif s["kind"] == "hot":
            console.print("\n".join(hot.summary(s)))
        elif s["kind"] == "router_load":
            table = Table(title=f"router-like load (books balance: {s['books_balance']})",
                          title_justify="left")
            for column in LOAD_HEAD:
                table.add_column(column, justify="right")
            table.add_row(*load_row(s))
            console.print(table)
