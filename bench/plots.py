"""The suite's pictures: throughput per method, ack latency CDFs, warm-up time on a slow tier.

throughput.png: one panel per warm-up scenario; per method, GB/s of heads warmed (solid)
and of warm-up + the consumer's read (hatched: what a reader of the files sees). fio and
vmtouch are drawn in grey so the eye finds the references. latency_cdf.png: for each
request size, the daemon's ack latency against the echo floor, log scale; plus the
router-like load when it ran. tier_latency.png: one panel per slow-tier scenario, warm-up
time against the tier's latency, one line per method (log scales; 0 ms on a linear stretch),
the daemon's default drawn thick, and the ideal of a slot-capped tier as a black cross.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server, and no Tk import

import datasets
import matplotlib.pyplot as plt

COLORS = {"daemon": "#1f6feb", "tool": "#8b949e", "python": "#d29922", "baseline": "#6e7781"}


def throughput(results: dict[str, Any], path: Path) -> bool:
    warmups = [s for s in results["scenarios"] if s["kind"] == "warmup"]
    if not warmups:
        return False
    rows = max(len([m for m in s["methods"].values() if "gb_s" in m]) for s in warmups)
    ncols = min(3, len(warmups))
    nrows = -(-len(warmups) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, (0.42 * rows + 1.6) * nrows),
                             squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(warmups):]:
        ax.set_visible(False)
    for ax, scenario in zip(flat, warmups, strict=False):
        names, solid, hatched, colors = [], [], [], []
        for name, m in scenario["methods"].items():
            if m.get("gb_s") is None or name == "none":
                continue
            names.append(name)
            solid.append(m["gb_s"])
            total = m["total_s"]
            hatched.append(m["bytes"] / 1e9 / total if total else 0.0)
            colors.append(COLORS.get(m["kind"], "#444"))
        y = list(range(len(names)))
        ax.barh([i - 0.2 for i in y], solid, height=0.38, color=colors, label="warm-up")
        ax.barh([i + 0.2 for i in y], hatched, height=0.38, color=colors, alpha=0.45,
                hatch="///", label="warm-up + consumer read")
        ax.set_yticks(y, names, fontsize=8)
        ax.invert_yaxis()
        s = scenario["settings"]
        ax.set_title(f"{s['dataset']} {scenario['state']}, head "
                     f"{datasets.format_size(s['head_bytes'])}", fontsize=9)
        ax.set_xlabel("GB/s of heads (median)", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    return save(fig, path, "kvprefetchd vs fio, vmtouch and a 16-thread pread pool", results)


def latency_cdf(results: dict[str, Any], path: Path) -> bool:
    ack = next((s for s in results["scenarios"] if s["kind"] == "ack_latency"), None)
    load = next((s for s in results["scenarios"] if s["kind"] == "router_load"), None)
    if ack is None and load is None:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    if ack is not None:
        mode = "idle" if "idle" in ack["results"] else next(iter(ack["results"]))
        client = ack["settings"]["clients"][0]
        styles = ["-", "--", ":", "-."]
        for index, (size, per_client) in enumerate(ack["results"][mode].items()):
            style = styles[index % len(styles)]
            for target, color in (("daemon", COLORS["daemon"]), ("echo", COLORS["tool"])):
                cdf = per_client[client][target]["cdf_us"]
                ax.plot([us for _, us in cdf], [q / 100 for q, _ in cdf], style, color=color,
                        label=f"{target}, {size} path{'' if size == '1' else 's'}")
    if load is not None:
        cdf = load["latency"]["cdf_us"]
        s = load["settings"]
        ax.plot([us for _, us in cdf], [q / 100 for q, _ in cdf], "-", color="#cf222e",
                label=f"router load: {s['clients']} clients, concurrent")
    ax.set_xscale("log")
    ax.set_xlabel("ack latency, µs (send to reply parsed)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("fire-and-forget prefetch: kvprefetchd against a msgpack echo floor",
                 fontsize=10)
    return save(fig, path)


def tier_latency(results: dict[str, Any], path: Path) -> bool:
    tiers = [s for s in results["scenarios"] if s["kind"] == "tier" and s["points"]]
    if not tiers:
        return False
    fig, axes = plt.subplots(1, len(tiers), figsize=(6.4 * len(tiers), 4.8), squeeze=False)
    for ax, scenario in zip(axes[0], tiers, strict=True):
        points = scenario["points"]
        names = dict.fromkeys(n for p in points for n in p["methods"] if n != "none")
        shades = {"daemon": iter(["#0a3069", "#1f6feb", "#54aeff", "#80ccff", "#218bff"]),
                  "python": iter(["#9a6700", "#d29922", "#e16f24", "#bf8700", "#fb8f44"]),
                  "tool": iter(["#24292f", "#8c959f", "#57606a"])}
        for name in names:
            xs, ys, kind = [], [], "tool"
            for point in points:
                m = point["methods"].get(name, {})
                if m.get("wall_s"):
                    xs.append(point["latency_ms"])
                    ys.append(m["wall_s"])
                    kind = m["kind"]
            default = name == "kvprefetchd-auto"
            ax.plot(xs, ys, "-" if kind != "tool" else "--", marker="o" if kind != "tool"
                    else "s", markersize=3, color=next(shades.get(kind, iter([])), "#444"),
                    linewidth=2.6 if default else 1.2, label=name)
        latencies = [p["latency_ms"] for p in points]
        ax.plot(latencies, [p["simulator_floor_s"] for p in points], ":", marker="_", color="k",
                label="simulator floor (estimate)")
        ideal = [(p["latency_ms"], p["ideal_s"]) for p in points if p.get("ideal_s")]
        if ideal:
            ax.plot(*zip(*ideal, strict=True), "kx", markersize=9,
                    label="files x latency / slots")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(latencies, [f"{v:g}" for v in latencies])
        ax.set_yscale("log")
        ax.set_xlabel("tier latency per fetch, ms")
        ax.set_ylabel("warm-up s (median)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        s = scenario["settings"]
        slots = f"{s['slots']} slots" if s["slots"] else "unlimited slots"
        ax.set_title(f"{s['dataset']}, head {datasets.format_size(s['head_bytes'])}, {slots}",
                     fontsize=9)
    return save(fig, path, "warm-up through the slow-tier simulator", results)


def save(fig: Any, path: Path, title: str = "", results: dict[str, Any] | None = None) -> bool:
    """Title (with the run's date and CPUs), lay out, write and free a figure."""
    if results is not None:
        fig.suptitle(f"{title} ({results['started'][:10]}, {results['machine']['cpus']} CPUs)",
                     fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw(results: dict[str, Any], out: Path) -> list[str]:
    """Draw what the results hold; the names of the files written."""
    written = []
    for name, painter in (("throughput.png", throughput), ("latency_cdf.png", latency_cdf),
                          ("tier_latency.png", tier_latency)):
        if painter(results, out / name):
            written.append(name)
    return written
