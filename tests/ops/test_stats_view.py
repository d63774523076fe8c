"""`kvprefetch stats` for a person: one screen, read off a full stats map."""

from __future__ import annotations

from stats_sample import realistic_stats

from kvprefetch.statsview import quantile, summarize_stats


def test_the_summary_fits_one_screen() -> None:
    text = summarize_stats(realistic_stats())
    lines = text.splitlines()
    assert len(lines) <= 24 and max(map(len, lines)) <= 160, text
    assert lines[0].startswith("kvprefetchd ")
    assert "ack p99 ms" in text and "roots:" in text and "workers:" in text


def test_quantiles_interpolate_within_the_bucket() -> None:
    histogram = {"buckets": [0.001, 0.002, 0.004], "counts": [0, 10, 10, 0], "sum": 0.05,
                 "count": 20}
    assert quantile(histogram, 0.5) == "2.00"  # the 10th of 20: the top of (1, 2] ms
    assert quantile(histogram, 0.75) == "3.00"  # halfway through (2, 4] ms
    empty = {"buckets": [0.001], "counts": [0, 0], "sum": 0.0, "count": 0}
    assert quantile(empty, 0.5) == "-"
    above = {"buckets": [0.001], "counts": [0, 3], "sum": 1.0, "count": 3}
    assert quantile(above, 0.99) == ">1"
