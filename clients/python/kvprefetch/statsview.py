"""`kvprefetch stats` for a person: one screen of what matters, the raw map with --json.

Latency quantiles are read off the daemon's fixed-bucket histograms the way Prometheus'
histogram_quantile does (linear within the bucket that holds the rank), so the figures are
bucket-resolution estimates, and say so with a "<=" where the rank falls past every bound.
"""

from __future__ import annotations

from kvprefetch.stats import HistogramSnapshot, Stats

OUTCOME_ORDER = ("read", "resident", "missing", "rejected", "failed", "expired", "futile")


def quantile(histogram: HistogramSnapshot, q: float) -> str:
    """The q-quantile of a histogram, in ms, as text ("-" when it is empty)."""
    total = histogram["count"]
    if not total:
        return "-"
    rank = q * total
    seen = 0
    lower = 0.0
    for bound, count in zip(histogram["buckets"], histogram["counts"], strict=False):
        if seen + count >= rank and count:
            value = lower + (bound - lower) * (rank - seen) / count
            return f"{value * 1000:.2f}"
        seen += count
        lower = bound
    return f">{lower * 1000:.0f}"


def size_text(n: float) -> str:
    """Bytes for a person: B, KiB ... TiB (the CLI's, the stats screen's and doctor's)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def summarize_stats(stats: Stats) -> str:
    lines = [
        f"kvprefetchd {stats['version']}: up {stats['uptime_s']:.0f} s, engine "
        f"{stats['engine']}, warm mode {stats['warm_mode']}, {len(stats['workers'])} workers, "
        f"{stats['connections']} connections",
    ]
    files = stats["files"]
    counts_by_name: dict[str, int] = dict(files)  # type: ignore[arg-type]
    lines.append(
        f"files: accepted {files['accepted']:,}, dropped {files['dropped']:,}, rejected "
        f"{files['rejected_by_supervisor']:,}; "
        + ", ".join(f"{name} {counts_by_name.get(name, 0):,}" for name in OUTCOME_ORDER)
        + f"; in flight {files['in_flight']:,}; {size_text(stats['bytes_read'])} read"
    )
    lines.append("requests    count   errors  ack p50 ms  ack p99 ms")
    acks = stats["latency"]["ack_seconds"]
    counts: dict[str, list[int]] = {}
    for key, n in stats["requests"].items():
        op, _, result = key.partition(":")
        counts.setdefault(op, [0, 0])[0 if result == "ok" else 1] += n
    for op in sorted(set(counts) | set(acks)):
        ok, errors = counts.get(op, [0, 0])
        histogram = acks.get(op)
        p50 = quantile(histogram, 0.5) if histogram else "-"
        p99 = quantile(histogram, 0.99) if histogram else "-"
        lines.append(f"  {op:<16}{ok + errors:>7,} {errors:>8,} {p50:>11} {p99:>11}")
    wait = stats["latency"]["wait_seconds"]
    per_file = stats["latency"]["file_seconds"]
    lines.append(f"wait replies p50/p99 {quantile(wait, 0.5)}/{quantile(wait, 0.99)} ms; "
                 f"per file p50/p99 {quantile(per_file, 0.5)}/{quantile(per_file, 0.99)} ms")
    lines.append("workers: index pid queue/limit restarts rss")
    for worker in stats["workers"]:
        rss = worker.get("rss_bytes")
        lines.append(
            f"  {worker['index']} {worker['pid']} {worker['queue_depth']:,}/"
            f"{worker['queue_limit']:,} {worker['restarts']} "
            f"{size_text(rss) if rss is not None else '-'}"
            + ("" if worker["ready"] else " (starting)")
        )
    lines.append("roots:")
    for root in stats["roots"]:
        status = "" if root["status"] == "open" else f" [{root['status']}: {root['why']}]"
        lines.append(f"  {root['root']} ({root['fstype']}): rule {root['rule']}{status}")
    events = {name: n for name, n in sorted(stats["events"].items()) if n}
    if events:
        lines.append("events: " + ", ".join(f"{name} {n:,}" for name, n in events.items()))
    if stats["stuck"]:
        lines.append(f"stuck children: {len(stats['stuck'])} (see --json)")
    return "\n".join(lines)
