"""Small helpers shared by the benchmarks: percentiles, summaries and text tables."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99 and max of `values`, each multiplied by `scale`."""
    data = [v * scale for v in values]

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "count": len(data),
        "mean": r(sum(data) / len(data)) if data else None,
        "p50": r(percentile(data, 50)),
        "p90": r(percentile(data, 90)),
        "p99": r(percentile(data, 99)),
        "max": r(max(data)) if data else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable in a terminal)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    out = [line(list(headers)), "| " + " | ".join("-" * w for w in widths) + " |"]
    out.extend(line(r) for r in cells)
    return "\n".join(out)
