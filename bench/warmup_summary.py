"""The warm-up's figures: per method, medians over repetitions and ratios paired per
repetition (method/reference in the same repetition: absolute times drift with the
host, ratios within one repetition do not); and the table warmup.py prints.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from warmup_methods import BASELINE, kind


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def paired_ratio(mine: Sequence[float | None], ref: Sequence[float | None]) -> float | None:
    """Median over repetitions of mine/ref measured in the same repetition."""
    ratios = [a / b for a, b in zip(mine, ref, strict=True) if a is not None and b]
    return statistics.median(ratios) if ratios else None


def summarize(methods: list[str], runs: dict[str, list[dict[str, Any]]], files: int,
              head: int, skipped: dict[str, str]) -> dict[str, Any]:
    asked = files * head
    warm_of = {m: [r["warm_s"] for r in runs[m]] for m in methods}
    # A reference left out of the scenario (or skipped) gives no ratio.
    has_fio = "fio" in warm_of and "fio" not in skipped
    has_vmtouch = "vmtouch" in warm_of and "vmtouch" not in skipped
    total_of = {m: [r["total_s"] for r in runs[m]] for m in methods}
    fio_runtime = [r["detail"].get("fio_runtime_s") for r in runs.get("fio", [])]
    out: dict[str, Any] = {}
    for method in methods:
        if method in skipped:
            out[method] = {"status": f"skipped: {skipped[method]}"}
            continue
        rs = runs[method]
        warm_s = warm_of[method]
        med = median([w for w in warm_s if w is not None])
        consumer = [r["consumer_s"] for r in rs]
        cpu = [r["cpu_s"] for r in rs if r["cpu_s"] is not None]
        whole = [r["resident"]["whole_file_bytes_per_file"] for r in rs]
        in_head = [r["resident"]["head_bytes_per_file"] for r in rs]
        entry: dict[str, Any] = {
            "status": "ok" if all(r["ok"] for r in rs) else "suspect: see runs[].ok",
            "kind": kind(method),
            "files": files,
            "bytes": asked,
            "median_s": med,
            "reps_s": warm_s,
            "gb_s": asked / 1e9 / med if med else None,
            "files_s": files / med if med else None,
            "ratio_to_fio": None if method == BASELINE or not has_fio
            else paired_ratio(warm_s, warm_of["fio"]),
            "ratio_to_vmtouch": None if method == BASELINE or not has_vmtouch
            else paired_ratio(warm_s, warm_of["vmtouch"]),
            # fio's own job_runtime leaves out its start-up (parsing, setting up every file)
            "ratio_to_fio_runtime": None if method == BASELINE or not has_fio
            else paired_ratio(warm_s, fio_runtime),
            "consumer": {"median_s": median(consumer), "reps_s": consumer},
            "total": {
                "median_s": median(total_of[method]),
                "reps_s": total_of[method],
                "ratio_to_fio": None if not has_fio
                else paired_ratio(total_of[method], total_of["fio"]),
                "ratio_to_vmtouch": None if not has_vmtouch
                else paired_ratio(total_of[method], total_of["vmtouch"]),
                "ratio_to_none": paired_ratio(total_of[method], total_of[BASELINE])
                if BASELINE in runs and BASELINE not in skipped else None,
            },
            "resident": {
                "asked_per_file": head,
                "whole_file_bytes_per_file": median(whole),
                "head_bytes_per_file": median(in_head),
                "brought_over_asked": (median(whole) or 0) / head,
                "measured": "after the consumer read" if method == BASELINE
                else "after the warm-up, before the consumer read",
            },
            "disk_read_bytes_per_file": median(
                [(r["consumer_disk_read_bytes"] if method == BASELINE else r["disk_read_bytes"])
                 / files for r in rs]),
            "disturbed_runs_kept": sum(1 for r in rs if r["interference"]),
            "runs_redone": sum(len(r["discarded"]) for r in rs),
            "foreign_cpu_s_median": median([r["foreign_cpu_s"] for r in rs]),
            "cpu": {
                "median_s": median(cpu),
                "reps_s": cpu,
                "s_per_gb": (median(cpu) or 0) / (asked / 1e9) if cpu else None,
                "what": {"daemon": "workers + supervisor (psutil)", "tool": "child rusage",
                         "python": "this process (all threads)", "baseline": "-"}[kind(method)],
            },
            "runs": rs,
        }
        out[method] = entry
    return out


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> str:
    head = ("method", "warm s", "GB/s", "files/s", "x fio", "x fio-rt", "x vmt", "consumer s",
            "sum s",
            "sum x none", "cached/file", "head warm", "CPU s/GB", "disturbed/redone")
    rows = [head]
    for method, r in results["methods"].items():
        if not r["status"].startswith(("ok", "suspect")):
            rows.append((method, r["status"], *[""] * (len(head) - 2)))
            continue
        res = r["resident"]
        rows.append((
            method + ("" if r["status"] == "ok" else " (!)"),
            fmt(r["median_s"], ".3f"), fmt(r["gb_s"], ".2f"), fmt(r["files_s"], ".0f"),
            fmt(r["ratio_to_fio"], ".2f"), fmt(r["ratio_to_fio_runtime"], ".2f"),
            fmt(r["ratio_to_vmtouch"], ".2f"),
            fmt(r["consumer"]["median_s"], ".3f"), fmt(r["total"]["median_s"], ".3f"),
            fmt(r["total"]["ratio_to_none"], ".2f"),
            f"{res['whole_file_bytes_per_file'] / (1 << 20):.2f} MiB",
            f"{100 * res['head_bytes_per_file'] / res['asked_per_file']:.0f}%",
            fmt(r["cpu"]["s_per_gb"], ".2f"),
            f"{r['disturbed_runs_kept']}/{r['runs_redone']}",
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                     for row in rows)
