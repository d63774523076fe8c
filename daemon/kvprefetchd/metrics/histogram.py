"""Latency histograms: fixed buckets, pure arithmetic, cheap enough to observe every ack.

All a worker needs to time its files, and nothing more: the worker imports this
module alone, so it never loads the exposition or the HTTP responder. The
supervisor keeps histograms for acks, `wait` replies and files (merged from the
workers' reports) and puts their `snapshot()` in `stats["latency"]`:

    {"buckets": [0.001, 0.01, 0.1],   # finite upper bounds, increasing
     "counts":  [5, 2, 0, 1],         # per bucket, NOT cumulative; the last is > max bound
     "sum": 0.123, "count": 8}
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Sequence

from kvprefetch.stats import HistogramSnapshot

# Acknowledgements are the daemon's promise (microseconds for a fire-and-forget
# prefetch, tens of ms for 100k paths), so the ack buckets start at 10 us.
ACK_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
# A file's latency (queued -> outcome): page-cache hits in tens of us, a recall
# from a remote tier in seconds.
FILE_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# A `wait` request's elapsed time: at most its timeout_ms, usually under a second.
WAIT_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)


class Histogram:
    """Counts of observations per bucket (`value <= bound`, as Prometheus' `le`), sum, count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = ACK_BUCKETS) -> None:
        bounds = tuple(float(b) for b in bounds)
        if not bounds:
            raise ValueError("a histogram needs at least one bucket bound")
        if any(not math.isfinite(b) for b in bounds):
            raise ValueError("bucket bounds must be finite (+Inf is implicit)")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError("bucket bounds must increase strictly")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if value != value:  # NaN: a bug upstream must not poison the sum
            return
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def observe_many(self, value: float, times: int) -> None:
        """`value` observed `times` times (e.g. a run of files settled at once)."""
        if times <= 0 or value != value:
            return
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def merge(self, counts: Sequence[int], total: float) -> None:
        """Add another histogram's bucket counts and sum (same bounds), e.g. a worker's."""
        if len(counts) != len(self.counts):
            raise ValueError("histograms with different buckets cannot be merged")
        for index, n in enumerate(counts):
            self.counts[index] += n
        self.count += sum(counts)
        self.sum += total

    def snapshot(self) -> HistogramSnapshot:
        return {
            "buckets": list(self.bounds),
            "counts": list(self.counts),
            "sum": self.sum,
            "count": self.count,
        }

    def quantile(self, q: float) -> float | None:
        """An estimate as PromQL's histogram_quantile makes it (linear within a bucket)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be within [0, 1]")
        if self.count == 0:
            return None
        rank = q * self.count
        seen = 0
        for index, n in enumerate(self.counts):
            if n and seen + n >= rank:
                if index == len(self.bounds):  # beyond the last bound: all we know is the bound
                    return self.bounds[-1]
                low = self.bounds[index - 1] if index else 0.0
                high = self.bounds[index]
                return low + (high - low) * (rank - seen) / n
            seen += n
        return self.bounds[-1]


class Histograms:
    """One Histogram per label value (e.g. per op), created on first use."""

    def __init__(self, bounds: Sequence[float] = ACK_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.by_label: dict[str, Histogram] = {}

    def observe(self, label: str, value: float) -> None:
        histogram = self.by_label.get(label)
        if histogram is None:
            histogram = self.by_label[label] = Histogram(self.bounds)
        histogram.observe(value)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        return {label: h.snapshot() for label, h in sorted(self.by_label.items())}
