"""Nearest-rank percentiles and the CDF points the suite plots, for every latency figure.

Nearest rank, no interpolation (the value at rank ceil(q/100 * n)): a percentile is
always a latency that was measured, and p999 of 1,000 samples is the maximum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CDF_POINTS = (*range(0, 100, 2), 99, 99.5, 99.9, 100)  # percent: enough for a plot


def nearest_rank(sorted_values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) of an ascending sequence; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, min(len(sorted_values), math.ceil(q / 100 * len(sorted_values))))
    return float(sorted_values[rank - 1])


def cdf(sorted_values: Sequence[float]) -> list[list[float]]:
    """[percent, value] at CDF_POINTS (0: the minimum); [] when empty."""
    if not sorted_values:
        return []
    return [[q, float(sorted_values[0]) if q == 0 else float(nearest_rank(sorted_values, q) or 0)]
            for q in CDF_POINTS]
