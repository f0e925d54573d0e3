"""Percentiles and the `Summary` record every latency figure of the benchmarks is."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from .records import Record


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@attrs.frozen
class Summary(Record):
    """count, mean, p50, p90, p99 and max of some samples (None when there are none)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


def summary(values: Iterable[float], scale: float = 1.0) -> Summary:
    """The `Summary` of `values`, each multiplied by `scale` (1e3: seconds to ms)."""
    data = [v * scale for v in values]

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return Summary(
        count=len(data),
        mean=r(sum(data) / len(data)) if data else None,
        p50=r(percentile(data, 50)),
        p90=r(percentile(data, 90)),
        p99=r(percentile(data, 99)),
        max=r(max(data)) if data else None,
    )


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)
