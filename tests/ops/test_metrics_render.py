"""Histogram arithmetic and the Prometheus exposition of `stats`, parsed back.

The exposition is read with prometheus_client's own parser, so a name, label or
value that a scraper would misread fails here.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from stats_sample import realistic_stats

from kvprefetch.stats import Stats, WorkerStats
from kvprefetchd.metrics.exposition import render
from kvprefetchd.metrics.histogram import (
    ACK_BUCKETS,
    FILE_BUCKETS,
    WAIT_BUCKETS,
    Histogram,
    Histograms,
)

# ---- Histogram -------------------------------------------------------------------------------


def test_a_value_on_a_bound_counts_in_that_bucket_as_le_says() -> None:
    histogram = Histogram([0.001, 0.01, 0.1])
    for value in (0.0, 0.001, 0.0010001, 0.01, 0.05, 0.1, 0.2, 7.0):
        histogram.observe(value)
    assert histogram.snapshot() == {
        "buckets": [0.001, 0.01, 0.1],
        "counts": [2, 2, 2, 2],
        "sum": pytest.approx(7.3620001),
        "count": 8,
    }


def test_nan_is_ignored_and_infinity_overflows() -> None:
    histogram = Histogram([1.0])
    histogram.observe(math.nan)
    histogram.observe(math.inf)
    assert histogram.counts == [0, 1]
    assert histogram.count == 1


@pytest.mark.parametrize("bounds", [[], [0.1, 0.1], [0.2, 0.1], [0.1, math.inf], [math.nan]])
def test_bad_bounds_are_refused(bounds: list[float]) -> None:
    with pytest.raises(ValueError):
        Histogram(bounds)


def test_quantile_interpolates_within_a_bucket_like_histogram_quantile() -> None:
    histogram = Histogram([1.0, 2.0, 4.0])
    assert histogram.quantile(0.5) is None
    for value in (0.5, 1.5, 1.5, 3.0):
        histogram.observe(value)
    assert histogram.quantile(0.25) == pytest.approx(1.0)  # 1 of 4 in (0, 1]
    assert histogram.quantile(0.5) == pytest.approx(1.5)   # halfway through (1, 2]
    assert histogram.quantile(1.0) == pytest.approx(4.0)
    histogram.observe(100.0)
    assert histogram.quantile(1.0) == 4.0  # beyond the last bound: the bound is all we know
    with pytest.raises(ValueError):
        histogram.quantile(1.5)


def test_histograms_keep_one_per_label() -> None:
    family = Histograms(ACK_BUCKETS)
    family.observe("prefetch", 0.0002)
    family.observe("ping", 0.00002)
    family.observe("prefetch", 0.5)
    snapshot = family.snapshot()
    assert list(snapshot) == ["ping", "prefetch"]
    assert snapshot["prefetch"]["count"] == 2
    assert snapshot["ping"]["buckets"] == list(ACK_BUCKETS)


@pytest.mark.parametrize(
    "bounds", [ACK_BUCKETS, FILE_BUCKETS, WAIT_BUCKETS]
)
def test_the_shipped_bucket_sets_are_valid(bounds: tuple[float, ...]) -> None:
    Histogram(bounds)


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=200))
def test_every_value_lands_in_exactly_the_bucket_whose_range_holds_it(values: list[float]) -> None:
    bounds = [0.001, 0.01, 0.1, 1.0, 10.0]
    histogram = Histogram(bounds)
    for value in values:
        histogram.observe(value)
    assert sum(histogram.counts) == histogram.count == len(values)
    assert histogram.sum == pytest.approx(math.fsum(values))
    edges = [-math.inf, *bounds, math.inf]
    for index, count in enumerate(histogram.counts):
        assert count == sum(1 for v in values if edges[index] < v <= edges[index + 1])


# ---- render ----------------------------------------------------------------------------------


def parse(body: bytes) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """{family: {(sample name, sorted labels): value}} and the family types, via the real parser."""
    families: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        samples = families.setdefault(f"{family.name}:{family.type}", {})
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families


def sample(
    families: dict[str, Any], family: str, name: str | None = None, **labels: str
) -> float:
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = families[family]
    return values[(name or family.split(":")[0], tuple(sorted(labels.items())))]


def test_render_names_labels_and_values() -> None:
    f = parse(render(realistic_stats()))
    assert sample(f, "kvprefetchd_build_info:gauge", "kvprefetchd_build_info", version="0.1.0") == 1
    assert sample(
        f, "kvprefetchd_engine_info:gauge", "kvprefetchd_engine_info",
        engine="io_uring", warm_mode="read",
    ) == 1
    assert sample(f, "kvprefetchd_uptime_seconds:gauge") == 12.5
    requests = "kvprefetchd_requests:counter"
    total = "kvprefetchd_requests_total"
    assert sample(f, requests, total, op="prefetch", result="ok") == 10
    assert sample(f, requests, total, op="prefetch", result="overloaded") == 2
    assert sample(f, requests, total, op="ping", result="ok") == 3
    assert sample(f, requests, total, op="none", result="bad_request") == 1
    assert sample(f, requests, total, op="unknown", result="unknown_op") == 2
    assert sample(f, requests, total, op="none", result="too_large") == 1
    events, events_total = "kvprefetchd_events:counter", "kvprefetchd_events_total"
    assert sample(f, events, events_total, event="connections_refused") == 4
    assert sample(f, events, events_total, event="reloads") == 2
    files = "kvprefetchd_files:counter"
    assert sample(f, files, "kvprefetchd_files_total", outcome="read") == 20
    assert sample(f, files, "kvprefetchd_files_total", outcome="rejected") == 3  # 2 + 1
    assert sample(f, files, "kvprefetchd_files_total", outcome="dropped") == 5
    assert "kvprefetchd_dropped:counter" not in f  # counted once: files{outcome="dropped"}
    assert sample(
        f, "kvprefetchd_files_accepted:counter", "kvprefetchd_files_accepted_total"
    ) == 40
    assert sample(f, "kvprefetchd_files_in_flight:gauge") == 2
    assert sample(
        f, "kvprefetchd_bytes_read:counter", "kvprefetchd_bytes_read_total"
    ) == 20 * 1048576
    assert sample(
        f, "kvprefetchd_worker_restarts:counter", "kvprefetchd_worker_restarts_total"
    ) == 1
    assert sample(
        f, "kvprefetchd_workers_killed_wedged:counter", "kvprefetchd_workers_killed_wedged_total"
    ) == 1
    assert sample(f, "kvprefetchd_worker_silent_seconds:gauge", worker="0") == 2.5
    assert sample(f, "kvprefetchd_worker_silent_seconds:gauge", worker="1") == 0
    assert sample(f, "kvprefetchd_queue_depth:gauge", worker="0") == 3
    assert sample(f, "kvprefetchd_queue_depth:gauge", worker="1") == 0
    assert sample(f, "kvprefetchd_queue_limit:gauge") == 8192
    assert sample(f, "kvprefetchd_other_mount_stuck_threads:gauge", worker="0") == 2
    assert sample(f, "kvprefetchd_other_mount_stuck_threads:gauge", worker="1") == 0  # no report
    assert sample(f, "kvprefetchd_other_mount_refused:counter",
                  "kvprefetchd_other_mount_refused_total", worker="0") == 5
    assert sample(f, "kvprefetchd_standby_reads:counter",
                  "kvprefetchd_standby_reads_total", worker="0") == 7
    assert sample(f, "kvprefetchd_standby_reads:counter",
                  "kvprefetchd_standby_reads_total", worker="1") == 0  # no report
    assert sample(f, "kvprefetchd_worker_ready:gauge", worker="1") == 0
    assert sample(f, "kvprefetchd_worker_rss_bytes:gauge", worker="1") == 19_000_000
    assert sample(
        f, "kvprefetchd_worker_cpu_seconds:counter", "kvprefetchd_worker_cpu_seconds_total",
        worker="0",
    ) == 1.5
    assert sample(f, "kvprefetchd_worker_open_fds:gauge", worker="1") == 7
    assert sample(
        f, "kvprefetchd_worker_dedup:counter", "kvprefetchd_worker_dedup_total",
        worker="0", kind="recent",
    ) == 4
    # the supervisor's own figures are the standard process_* metrics of the process serving
    # the scrape (here, this test's), never home-made names
    assert sample(f, "process_resident_memory_bytes:gauge") > 0
    assert not [key for key in f if key.startswith("kvprefetchd_supervisor_")]
    assert sample(f, "kvprefetchd_kv_profile_stale:gauge", profile="qwen3-8b") == 1
    assert sample(f, "kvprefetchd_kv_profile_stale:gauge", profile="llama") == 0
    assert sample(
        f, "kvprefetchd_kv_resolve_seconds:counter", "kvprefetchd_kv_resolve_seconds_total"
    ) == pytest.approx(0.0125)
    assert sample(
        f, "kvprefetchd_root_info:gauge", "kvprefetchd_root_info",
        root="/mnt/kv", fstype="gpfs", rule="tier", extent="head", keep="pagecache",
    ) == 1


def test_render_histograms_are_cumulative_with_sum_and_count() -> None:
    f = parse(render(realistic_stats()))
    ack = "kvprefetchd_request_ack_seconds:histogram"
    bucket = "kvprefetchd_request_ack_seconds_bucket"
    assert sample(f, ack, bucket, op="prefetch", le="5e-05") == 1
    assert sample(f, ack, bucket, op="prefetch", le="0.0001") == 2
    assert sample(f, ack, bucket, op="prefetch", le="0.00025") == 2
    assert sample(f, ack, bucket, op="prefetch", le="+Inf") == 3
    assert sample(f, ack, "kvprefetchd_request_ack_seconds_count", op="prefetch") == 3
    assert sample(f, ack, "kvprefetchd_request_ack_seconds_sum", op="prefetch") == (
        pytest.approx(0.00043)
    )
    assert sample(f, ack, "kvprefetchd_request_ack_seconds_count", op="ping") == 1
    wait = "kvprefetchd_wait_seconds:histogram"
    assert sample(f, wait, "kvprefetchd_wait_seconds_bucket", le="0.005") == 1
    assert sample(f, wait, "kvprefetchd_wait_seconds_bucket", le="+Inf") == 2
    files = "kvprefetchd_file_seconds:histogram"
    assert sample(f, files, "kvprefetchd_file_seconds_bucket", le="0.0025") == 3
    assert sample(f, files, "kvprefetchd_file_seconds_count") == 4
    # Every bucket series is non-decreasing in le.
    for family in (ack, wait, files):
        series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        for (name, labels), value in f[family].items():
            if name.endswith("_bucket"):
                rest = tuple(kv for kv in labels if kv[0] != "le")
                le = float(dict(labels)["le"])
                series.setdefault(rest, []).append((le, value))
        for points in series.values():
            counts = [v for _, v in sorted(points)]
            assert counts == sorted(counts)


def test_every_metric_name_follows_prometheus_conventions() -> None:
    for family in text_string_to_metric_families(render(realistic_stats()).decode()):
        # ours, or the standard process collector's (prometheus_client names those)
        assert family.name.startswith(("kvprefetchd_", "process_")), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        for unit in ("_ms", "_us", "_kb", "_mb"):
            assert not family.name.endswith(unit)


def test_the_sample_has_every_key_of_the_schema() -> None:
    """The fixture is the schema's: a key the daemon gains or loses fails here (and mypy)."""
    sample_stats = realistic_stats()
    assert set(sample_stats) == Stats.__required_keys__
    every_worker_key = WorkerStats.__required_keys__ | WorkerStats.__optional_keys__
    assert all(set(worker) == every_worker_key for worker in sample_stats["workers"])


def test_an_empty_histogram_still_renders_its_family() -> None:
    stats = realistic_stats()
    stats["latency"]["wait_seconds"] = Histogram(WAIT_BUCKETS).snapshot()
    f = parse(render(stats))
    wait = "kvprefetchd_wait_seconds:histogram"
    assert sample(f, wait, "kvprefetchd_wait_seconds_count") == 0
    assert sample(f, wait, "kvprefetchd_wait_seconds_bucket", le="+Inf") == 0


def test_labels_are_escaped() -> None:
    stats = realistic_stats()
    stats["roots"] = [
        {"root": '/mnt/"odd"\\path\n', "fstype": "nfs4", "rule": "pagecache", "why": "",
         "status": "open", "reopened": 0, "extent": "head", "keep": "pagecache",
         "futile": False}
    ]
    f = parse(render(stats))
    assert sample(
        f, "kvprefetchd_root_info:gauge", "kvprefetchd_root_info",
        root='/mnt/"odd"\\path\n', fstype="nfs4", rule="pagecache", extent="head",
        keep="pagecache",
    ) == 1


def test_rendering_starts_no_thread() -> None:
    before = threading.active_count()
    render(realistic_stats())
    assert threading.active_count() == before


def test_render_of_a_real_daemons_stats(daemon: Any) -> None:
    (daemon.root / "a.bin").write_bytes(b"x" * 8192)
    daemon.call("prefetch", paths=[str(daemon.root / "a.bin"), "/etc/passwd"], wait=True)
    stats = daemon.call("stats")["stats"]
    # The daemon produces exactly the schema's keys, as the fixture above does.
    assert set(stats) == Stats.__required_keys__
    every_worker_key = WorkerStats.__required_keys__ | WorkerStats.__optional_keys__
    assert all(set(worker) == every_worker_key for worker in stats["workers"])
    f = parse(render(stats))
    total = "kvprefetchd_requests_total"
    assert sample(f, "kvprefetchd_requests:counter", total, op="prefetch", result="ok") == 1
    outcomes = f["kvprefetchd_files:counter"]
    assert outcomes[("kvprefetchd_files_total", (("outcome", "rejected"),))] == 1
    assert sum(outcomes.values()) == 2
    assert set(dict(k[1])["worker"] for k in f["kvprefetchd_queue_depth:gauge"]) == {"0", "1"}
    assert sample(f, "kvprefetchd_worker_rss_bytes:gauge", worker="0") > 0
