"""The workers' metric families, from the `workers` of a `stats` reply (exposition.py).

One series per worker index: what its queue holds and has done, and its process's figures
(psutil's, as the worker reports them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvprefetch.stats import ProcessFigures, WorkerStats


def worker_families(workers: Sequence[WorkerStats]) -> Iterator[Metric]:
    """Per worker: its queue, its holds, its fast path, its lanes and its process."""
    labels = [str(w["index"]) for w in workers]
    depth = GaugeMetricFamily(
        "kvprefetchd_queue_depth", "Files outstanding per worker.", labels=["worker"]
    )
    ready = GaugeMetricFamily(
        "kvprefetchd_worker_ready", "1 once a worker has booted.", labels=["worker"]
    )
    batches = CounterMetricFamily(
        "kvprefetchd_worker_batches", "Engine batches run, per worker (since it started).",
        labels=["worker"],
    )
    silent = GaugeMetricFamily(
        "kvprefetchd_worker_silent_seconds",
        "Seconds since a worker that owes outcomes last reported (0 when it owes none); "
        "at worker_timeout it is killed as wedged.",
        labels=["worker"],
    )
    dedup = CounterMetricFamily(
        "kvprefetchd_worker_dedup",
        "Files skipped as duplicates, per worker (recent: warmed within dedup_ttl_ms; "
        "in_flight: already being read).",
        labels=["worker", "kind"],
    )
    probed = CounterMetricFamily(
        "kvprefetchd_worker_probed",
        "Files a worker's fast path settled on its own thread (native/probe.c), never "
        "handed to an engine, by outcome (resident, missing).",
        labels=["worker", "outcome"],
    )
    stuck = GaugeMetricFamily(
        "kvprefetchd_other_mount_stuck_threads",
        "Threads of a worker's lane for files behind another mount beneath their root "
        "held by a read past its stall time (at most other_mount_threads).",
        labels=["worker"],
    )
    refused = CounterMetricFamily(
        "kvprefetchd_other_mount_refused",
        "Files behind another mount beneath their root failed at once "
        "(mount_unresponsive): every thread of that lane was stuck.",
        labels=["worker"],
    )
    standby = CounterMetricFamily(
        "kvprefetchd_standby_reads",
        "Files refused on arrival (their tier's queue would have made them late) and read "
        "later, into a slot the tier had free before their consumer could get to them.",
        labels=["worker"],
    )
    held = GaugeMetricFamily(
        "kvprefetchd_held_files",
        "Files a worker holds open for their consumer now (hold-open warming, docs/tiers.md).",
        labels=["worker"],
    )
    released = CounterMetricFamily(
        "kvprefetchd_hold_released",
        "Held files let go, by why: opened (by their consumer), expired (hold_seconds), "
        "budget (hold_max_files or hold_max_bytes), deleted, replaced, evicted, closed.",
        labels=["worker", "why"],
    )
    for label, worker in zip(labels, workers, strict=True):
        held.add_metric([label], worker["queue"].get("held_files", 0))
        for why, count in worker["hold_released"].items():
            released.add_metric([label, why], count)
        depth.add_metric([label], worker["queue_depth"])
        stuck.add_metric([label], worker["queue"].get("other_mount_stuck", 0))
        refused.add_metric([label], worker["queue"].get("other_mount_refused", 0))
        standby.add_metric([label], worker["queue"].get("standby_reads", 0))
        probed.add_metric([label, "resident"], worker["probed_resident"])
        probed.add_metric([label, "missing"], worker["probed_missing"])
        ready.add_metric([label], float(worker["ready"]))
        silent.add_metric([label], worker["silent_s"])
        batches.add_metric([label], worker["batches"])
        dedup.add_metric([label, "recent"], worker["dedup_recent"])
        dedup.add_metric([label, "in_flight"], worker["dedup_in_flight"])
    yield depth
    yield held
    yield released
    if workers:
        yield GaugeMetricFamily(
            "kvprefetchd_queue_limit",
            "Files a worker may have outstanding before new ones are dropped.",
            value=max(w["queue_limit"] for w in workers),
        )
    yield ready
    yield silent
    yield batches
    yield dedup
    yield probed
    yield stuck
    yield refused
    yield standby
    yield from _process("kvprefetchd_worker", "A worker", ["worker"], workers, labels)


def _process(
    prefix: str,
    who: str,
    label_names: list[str],
    rows: Sequence[ProcessFigures],
    label_values: Sequence[str] | None = None,
) -> Iterator[Metric]:
    """rss_bytes, cpu_seconds and open_fds (psutil figures) of one or more processes."""
    rss = GaugeMetricFamily(
        f"{prefix}_rss_bytes", f"{who}'s resident set size.", labels=label_names
    )
    cpu = CounterMetricFamily(
        f"{prefix}_cpu_seconds", f"{who}'s user and system CPU time.", labels=label_names
    )
    fds = GaugeMetricFamily(
        f"{prefix}_open_fds", f"{who}'s open file descriptors.", labels=label_names
    )
    values = label_values or [""] * len(rows)
    for label, row in zip(values, rows, strict=True):
        key = [label] if label_names else []
        if "rss_bytes" in row:
            rss.add_metric(key, row["rss_bytes"])
        if "cpu_seconds" in row:
            cpu.add_metric(key, row["cpu_seconds"])
        if "open_fds" in row:
            fds.add_metric(key, row["open_fds"])
    for family in (rss, cpu, fds):
        if family.samples:
            yield family
