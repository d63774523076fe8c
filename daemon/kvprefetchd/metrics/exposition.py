"""The Prometheus exposition of a `stats` reply: text format 0.0.4, or OpenMetrics 1.0 when
the scraper asks for it (Accept: application/openmetrics-text).

Built with prometheus_client from a collector over a private registry, fed the very
`Stats` the `stats` op returns: the page says exactly what the op says, with no second
set of books to drift. Typed by the one stats schema (kvprefetch.stats), so a key the
daemon stops producing fails mypy here instead of rendering nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import cast

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.openmetrics import exposition as openmetrics_exposition
from prometheus_client.registry import Collector

from kvprefetch.stats import (
    ROOT_STATUSES,
    FileCounts,
    HistogramSnapshot,
    KVStats,
    LatencyStats,
    Stats,
)
from kvprefetchd.metrics.limits import CLOSE_REASONS, SCRAPE_RESULTS
from kvprefetchd.metrics.workers import worker_families
from kvprefetchd.protocol import OUTCOMES

# The text format generate_latest() writes: what every scraper parses, the default.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = openmetrics_exposition.CONTENT_TYPE_LATEST

def render(stats: Stats, *, openmetrics: bool = False) -> bytes:
    """The exposition of one `stats` reply, and Prometheus's standard process_* metrics of
    the supervisor (the process that serves the scrape: prometheus_client reads its /proc)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    ProcessCollector(registry=registry)
    if openmetrics:
        body: bytes = openmetrics_exposition.generate_latest(registry)  # type: ignore[no-untyped-call]
        return body
    return generate_latest(registry)


class StatsCollector(Collector):
    """Turns one `Stats` into metric families (a fresh collector per scrape)."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for family in itertools.chain(
            _identity(stats),
            _requests(stats["requests"], stats["events"]),
            _log_sink(stats["events"]),
            _metrics_endpoint(stats["events"]),
            _files(stats["files"], stats),
            worker_families(stats["workers"]),
            _kv(stats["kv"]),
            _latency(stats["latency"]),
        ):
            if family.samples:  # a family with nothing to say is left out, not sent empty
                yield family


def _identity(stats: Stats) -> Iterator[Metric]:
    build = InfoMetricFamily("kvprefetchd_build", "The daemon's version.")
    build.add_metric([], {"version": stats["version"]})
    yield build
    engine = InfoMetricFamily(
        "kvprefetchd_engine", "The I/O engine the workers run and the warm mode."
    )
    engine.add_metric([], {"engine": stats["engine"], "warm_mode": stats["warm_mode"]})
    yield engine
    yield GaugeMetricFamily(
        "kvprefetchd_uptime_seconds", "Seconds since the supervisor started.",
        value=stats["uptime_s"],
    )
    yield GaugeMetricFamily(
        "kvprefetchd_connections", "Client connections open now.", value=stats["connections"]
    )
    roots = InfoMetricFamily(
        "kvprefetchd_root", "An allowed root, its file system and its residency rule."
    )
    status = StateSetMetricFamily(
        "kvprefetchd_root_status",
        "Each allowed root's state now (stats roots[].status): open; missing (its path "
        "leads nowhere, its files are missing); refused (its path is refused; a directory "
        "opened earlier stays in force); unresponsive (its file system does not answer).",
        labels=["root"],
    )
    reopened = CounterMetricFamily(
        "kvprefetchd_root_reopened",
        "Times a root was opened again: found replaced (removed and made again, mounted "
        "over or unmounted, remounted) or back after missing.",
        labels=["root"],
    )
    futile = GaugeMetricFamily(
        "kvprefetchd_root_futile",
        "1 when a warmed file of the root was found cold on reopening: its file system drops "
        "what a warm-up leaves at the next open, so its files settle futile (docs/tiers.md).",
        labels=["root"],
    )
    for root in stats["roots"]:
        roots.add_metric([], {"root": root["root"], "fstype": root["fstype"], "rule": root["rule"],
                              "extent": root["extent"], "keep": root["keep"]})
        status.add_metric([root["root"]], {name: name == root["status"] for name in ROOT_STATUSES})
        reopened.add_metric([root["root"]], root["reopened"])
        futile.add_metric([root["root"]], float(root["futile"]))
    yield roots
    yield status
    yield reopened
    yield futile
    # The supervisor's own figures are the standard process_* metrics (render()).


def _requests(requests: Mapping[str, int], events: Mapping[str, int]) -> Iterator[Metric]:
    """{"op:ok" | "op:error_CODE": n} -> requests_total{op,result}; events -> events_total."""
    family = CounterMetricFamily(
        "kvprefetchd_requests",
        "Requests by op and result (ok, or an error code; op none when the frame never "
        "parsed, unknown when its op is not served).",
        labels=["op", "result"],
    )
    for key, value in sorted(requests.items()):
        op, _, result = key.partition(":")
        family.add_metric([op, result.removeprefix("error_")], value)
    yield family
    other = CounterMetricFamily(
        "kvprefetchd_events",
        "Other counted events (reloads, refused connections and peers, paused accepts).",
        labels=["event"],
    )
    for event, value in sorted(events.items()):
        if not event.startswith(OWN_FAMILY_PREFIXES):
            other.add_metric([event], value)
    yield other


# Events with a family of their own (below), left out of kvprefetchd_events_total.
OWN_FAMILY_PREFIXES = ("log_", "metrics_")


def _log_sink(events: Mapping[str, int]) -> Iterator[Metric]:
    """The supervisor's log sink (logs.py): what it failed to write, and what it dropped."""
    yield _single(
        "kvprefetchd_log_write_errors",
        "Writes to the log sink that failed (ENOSPC, EIO, EPIPE...): retried with backoff, "
        "then the journal takes over when there is one.", "counter",
        events.get("log_write_errors", 0),
    )
    yield _single(
        "kvprefetchd_log_lines_dropped",
        "Log lines dropped because the sink was full (nobody reading) or failing; the log "
        "says how many once it works again.", "counter", events.get("log_lines_dropped", 0),
    )
    yield _single(
        "kvprefetchd_log_sink_replaced",
        "Times a failing log sink was replaced by the journal's stream.", "counter",
        events.get("log_sink_replaced", 0),
    )


def _metrics_endpoint(events: Mapping[str, int]) -> Iterator[Metric]:
    """This endpoint's own bounds (limits.py): each refusal counted by reason."""
    yield _event_counts(
        "kvprefetchd_metrics_scrapes",
        "Requests to the metrics endpoint by result (served, not_found, bad).",
        "result", SCRAPE_RESULTS, events, "metrics_",
    )
    yield _single(
        "kvprefetchd_metrics_cached_scrapes",
        "Scrapes answered with the page rendered less than metrics_cache_seconds before.",
        "counter", events.get("metrics_cached", 0),
    )
    yield _event_counts(
        "kvprefetchd_metrics_connections_closed",
        "Metrics connections closed unserved: expired (no whole request within "
        "metrics_header_timeout, or not done in 2 s), evicted (for a newcomer when every "
        "slot was taken), refused (no slot), refused_address "
        "(metrics_max_clients_per_address), refused_address_rate "
        "(metrics_rate_per_address), refused_rate (metrics_rate).",
        "reason", CLOSE_REASONS, events, "metrics_",
    )
    yield _single(
        "kvprefetchd_metrics_accept_pauses",
        "Times the metrics listener paused for 25 ms, having accepted 2,000 connections a "
        "second (a flood: the rest wait in the backlog).", "counter",
        events.get("metrics_accept_paused", 0),
    )


def file_outcomes(files: FileCounts) -> dict[str, int]:
    """Files by outcome: every outcome of accepted files `stats` counts (protocol.OUTCOMES,
    the books' own list, so a new outcome is a new series by construction), then `dropped`.
    The supervisor's rejections and the workers' are both `rejected`, as the protocol
    counts them."""
    counts = cast(Mapping[str, int], files)
    by_outcome = {outcome: counts[outcome] for outcome in OUTCOMES}
    by_outcome["rejected"] += files["rejected_by_supervisor"]
    by_outcome["dropped"] = files["dropped"]
    return by_outcome


def _files(files: FileCounts, stats: Stats) -> Iterator[Metric]:
    outcomes = CounterMetricFamily(
        "kvprefetchd_files",
        "Files by outcome (protocol v1 outcomes; rejected counts the supervisor's and the "
        "workers' refusals).",
        labels=["outcome"],
    )
    for outcome, value in file_outcomes(files).items():
        outcomes.add_metric([outcome], value)
    yield outcomes
    yield _single("kvprefetchd_files_accepted", "Files queued to a worker.", "counter",
                  files["accepted"])
    yield _single(
        "kvprefetchd_expired_replies",
        "Wait requests answered at their timeout before every file had an outcome.", "counter",
        files["expired_replies"],
    )
    yield _single("kvprefetchd_files_in_flight", "Files queued or being read now.", "gauge",
                  files["in_flight"])
    yield _single("kvprefetchd_bytes_read", "Bytes read to warm files.", "counter",
                  stats["bytes_read"])
    yield _single(
        "kvprefetchd_worker_restarts",
        "Workers respawned after dying or being killed as wedged.", "counter",
        stats["worker_restarts"],
    )
    yield _single(
        "kvprefetchd_workers_killed_wedged",
        "Workers killed (and replaced) for owing outcomes and saying nothing for "
        "worker_timeout.", "counter", stats["workers_killed_wedged"],
    )


def _kv(kv: KVStats) -> Iterator[Metric]:
    yield _single(
        "kvprefetchd_kv_resolved_requests",
        "KV requests (prefetch_blocks, resolve) mapped to paths.", "counter",
        kv["resolved_requests"],
    )
    yield _single(
        "kvprefetchd_kv_resolve_seconds",
        "Time spent hashing and mapping KV requests to paths.", "counter",
        kv["resolve_ms_total"] / 1e3,
    )
    stale = GaugeMetricFamily(
        "kvprefetchd_kv_profile_stale",
        "1 when a model profile's fingerprint looks stale (its files keep missing while "
        "another folder of the model exists).",
        labels=["profile"],
    )
    streak = GaugeMetricFamily(
        "kvprefetchd_kv_profile_missing_streak",
        "Consecutive missing files under a model profile's fingerprint.",
        labels=["profile"],
    )
    for profile in sorted(set(kv["profiles"]) | set(kv["stale"])):
        entry = kv["stale"].get(profile)
        stale.add_metric([profile], 1.0 if entry is not None and entry["stale"] else 0.0)
        if entry is not None:
            streak.add_metric([profile], entry["missing_streak"])
    yield stale
    yield streak


def _latency(latency: LatencyStats) -> Iterator[Metric]:
    ack = HistogramMetricFamily(
        "kvprefetchd_request_ack_seconds",
        "Time from a request's frame to its acknowledgement being queued, per op.",
        labels=["op"],
    )
    for op, snapshot in sorted(latency["ack_seconds"].items()):
        _add_histogram(ack, [op], snapshot)
    yield ack
    wait = HistogramMetricFamily(
        "kvprefetchd_wait_seconds",
        "Elapsed time of wait requests, until every file had an outcome or the timeout.",
    )
    _add_histogram(wait, [], latency["wait_seconds"])
    yield wait
    files = HistogramMetricFamily(
        "kvprefetchd_file_seconds", "Time from a file being queued to its outcome."
    )
    _add_histogram(files, [], latency["file_seconds"])
    yield files


def _event_counts(name: str, doc: str, label: str, values: Iterable[str],
                  events: Mapping[str, int], prefix: str) -> Metric:
    """A counter with one series per label value: the event `prefix + value` (0 when
    it never happened, so every series exists from the start)."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value in values:
        family.add_metric([value], events.get(prefix + value, 0))
    return family


def _single(name: str, doc: str, kind: str, value: float) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, doc, value=value)
    return GaugeMetricFamily(name, doc, value=value)


def _add_histogram(
    family: HistogramMetricFamily, labels: list[str], snapshot: HistogramSnapshot
) -> None:
    """Prometheus' cumulative (le, count) pairs from a snapshot's per-bucket counts."""
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip([*snapshot["buckets"], math.inf], snapshot["counts"], strict=True):
        running += n
        # repr() is the shortest exact text ("0.0001", "1e-05"); Prometheus parses both.
        buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), float(running)))
    family.add_metric(labels, buckets, snapshot["sum"])
