"""The slow tier's figures: per point and method, medians, paired ratios, and issue 13's targets.

Ratios are paired as in the local-disk suite: the median over repetitions of the method's
time divided by the reference's time in the same repetition. The references:
- the best pool: per repetition, the fastest of the {64, 256, 1024}-thread pools that ran;
- fio (io_uring at depth 1024, exactly the heads);
- on a tier with fetch slots, the ideal: files x fetches per file x mean latency / slots
  (no warmer can beat it: the tier serves at most `slots` fetches at once).
The targets (issue 13, item 2): the daemon with no tuning flags within 1.15x of the best
pool at 20 and 100 ms with unlimited slots, and within 1.1x of the ideal with 64 slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tier_methods import DEFAULT, TARGET_POOLS
from warmup_methods import BASELINE, kind
from warmup_summary import median, paired_ratio

POOL_TARGET = 1.15
POOL_TARGET_LATENCIES = (20.0, 100.0)
SLOT_TARGET = 1.1
# The simulator's own ceiling on this 2-vCPU VM (bench/tiersim/README.md, "The zero-latency
# ceiling", measured by bench/tiersim/ceiling.py): files of 256 KiB served per second at
# 0 ms, and 4,000 heads of 256 KiB at 100 ms with 1,024 fetches in flight.
CEILING = {
    "source": "bench/tiersim/README.md, 'The zero-latency ceiling' (bench/tiersim/ceiling.py)",
    "files_per_s_at_0ms": 6270,
    "heads_4000_at_100ms_1024_in_flight_s": [0.91, 1.05],
    "ideal_of_that_s": 0.4,
    "note": "the simulator copies every byte it serves (about 0.5 s per GB here); a result "
            "near simulator_floor_s measures the simulator, not the warmer",
}


def ideal_s(files: int, fetches_per_file: int, latency_ms: float, jitter_ms: float,
            slots: int) -> float | None:
    """files x fetches x mean latency / slots: the slot-capped tier's bound (None: no cap)."""
    if not slots:
        return None
    return files * fetches_per_file * (latency_ms + jitter_ms / 2) / 1000 / slots


def simulator_floor_s(files: int, fetches_per_file: int, latency_ms: float, jitter_ms: float,
                      in_flight: int) -> float:
    """An estimate of the simulator's floor: its copying at its 0 ms rate plus the waves of
    `in_flight` fetches (README: 0.64 + 4 x 0.1 s for 4,000 heads at 100 ms, measured
    0.91-1.05 s)."""
    waves = -(-files * fetches_per_file // max(1, in_flight))
    return files / CEILING["files_per_s_at_0ms"] + waves * (latency_ms + jitter_ms / 2) / 1000


def best_pool(runs: dict[str, list[dict[str, Any]]], reps: int) -> list[float | None]:
    """Per repetition, the fastest target pool that ran clean (None when none did)."""
    out: list[float | None] = []
    for rep in range(reps):
        times = [rs[rep]["wall_s"] for m, rs in runs.items()
                 if m in TARGET_POOLS and len(rs) > rep and rs[rep]["ok"]]
        out.append(min(times) if times else None)
    return out


def summarize_point(point: dict[str, Any], runs: dict[str, list[dict[str, Any]]], files: int,
                    head: int, skipped: dict[str, str]) -> dict[str, Any]:
    """One (latency, slots) point: per method its figures; the point's references."""
    reps = max((len(rs) for rs in runs.values()), default=0)
    pools = best_pool(runs, reps)
    fio = [r["wall_s"] for r in runs.get("fio", [])]
    ideal = point["ideal_s"]
    methods: dict[str, Any] = {}
    for method, reason in skipped.items():
        methods[method] = {"status": f"skipped: {reason}"}
    for method, rs in runs.items():
        if not rs:
            continue
        wall = [r["wall_s"] for r in rs]
        timed = [w for w in wall if w is not None]
        med = median(timed)
        methods[method] = {
            "status": "ok" if all(r["ok"] for r in rs) else "suspect: see runs[].ok",
            "kind": kind(method),
            "files": files,
            "bytes": files * head,
            "wall_s": med,
            "wall_s_min": min(timed) if timed else None,
            "wall_s_max": max(timed) if timed else None,
            "reps_s": wall,
            "files_s": files / med if med else None,
            "gb_s": files * head / 1e9 / med if med else None,
            "peak_in_flight": median([r["tier"]["peak_in_flight"] for r in rs]),
            "fetches": [r["tier"]["fetches"] for r in rs],
            "expected_fetches": rs[0]["expected_fetches"],
            "every_head_fetched": all(r["fetched_as_expected"] for r in rs),
            "head_cached_fraction": median([r["head_cached_fraction"] for r in rs
                                            if r["head_cached_fraction"] is not None]),
            "simulator_cpu_s": median([r["simulator_cpu_s"] for r in rs]),
            "foreign_cpu_s": median([r["foreign_cpu_s"] for r in rs]),
            "ratio_to_best_pool": None if method == BASELINE else paired_ratio(wall, pools),
            "ratio_to_fio": None if method == BASELINE or not fio else paired_ratio(wall, fio),
            "ratio_to_ideal": med / ideal if ideal and med else None,
            "runs": rs,
        }
    return {**point, "best_pool_reps_s": pools, "methods": methods}


def targets(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 13's targets at the points that have them; `met` None when unmeasured."""
    out = []
    for point in points:
        default = point["methods"].get(DEFAULT, {})
        label = f"{point['latency_ms']:g} ms, " + (f"{point['slots']} slots" if point["slots"]
                                                   else "unlimited slots")
        if point["slots"]:
            ratio, limit = default.get("ratio_to_ideal"), SLOT_TARGET
            reference, reference_s = "files x latency / slots", point["ideal_s"]
        elif point["latency_ms"] in POOL_TARGET_LATENCIES:
            ratio, limit = default.get("ratio_to_best_pool"), POOL_TARGET
            reference, reference_s = "best of " + ", ".join(TARGET_POOLS), \
                median([s for s in point["best_pool_reps_s"] if s is not None])
        else:
            continue
        out.append({"method": DEFAULT, "point": label, "latency_ms": point["latency_ms"],
                    "slots": point["slots"], "wall_s": default.get("wall_s"),
                    "reference": reference, "reference_s": reference_s, "ratio": ratio,
                    "target": limit, "met": None if ratio is None else ratio <= limit})
    return out


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def sweep_rows(points: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Methods x points: median wall s, x best pool (x ideal with slots), peak in flight."""
    head = ["method"] + [f"{p['latency_ms']:g} ms" + (f", {p['slots']} slots" if p["slots"]
                                                       else "") for p in points]
    names = list(dict.fromkeys(m for p in points for m in p["methods"]))
    rows = []
    for name in names:
        row = [name]
        for point in points:
            m = point["methods"].get(name)
            if m is None or m["status"].startswith("skipped"):
                row.append("-" if m is None else "skipped")
            elif name == BASELINE:
                row.append(f"{m['fetches'][0]} fetches")
            else:
                ratio = m["ratio_to_ideal"] if point["slots"] else m["ratio_to_best_pool"]
                bad = "" if m["status"] == "ok" else " (!)"
                row.append(f"{fmt(m['wall_s'], '.3f')} s ({fmt(ratio, '.2f')}x) "
                           f"{fmt(m['peak_in_flight'], '.0f')}{bad}")
        rows.append(row)
    return head, rows


TARGET_HEAD = ["target", "point", "kvprefetchd-auto s", "reference", "reference s", "ratio",
               "met"]


def target_rows(found: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [[f"<= {t['target']}x", t["point"], fmt(t["wall_s"], ".3f"), t["reference"],
             fmt(t["reference_s"], ".3f"), fmt(t["ratio"], ".2f"),
             "-" if t["met"] is None else "yes" if t["met"] else "NO"] for t in found]


def text_table(head: list[str], rows: Sequence[list[str]]) -> str:
    table = [head, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                     for row in table)
