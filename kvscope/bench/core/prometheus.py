"""Reading the server's `GET /metrics`: histogram buckets and quantiles of a window.

`histogram(text, name)` returns the cumulative bucket counts of one histogram;
`window(before, after)` subtracts two scrapes, so a quantile covers only what
happened between them; `quantile` interpolates inside the bucket as Prometheus'
`histogram_quantile` does (so its resolution is the bucket's width);
`counter_totals` sums counters (the speculative decoding counts of `bench throughput`).
"""

from __future__ import annotations

import math
import re

_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def histogram(text: str, name: str) -> dict[float, float]:
    """upper bound -> cumulative count for histogram `name` (no labels other than le)."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or m["name"] != f"{name}_bucket":
            continue
        le = re.search(r'le="([^"]+)"', m["labels"] or "")
        if le:
            out[math.inf if le[1] == "+Inf" else float(le[1])] = float(m["value"])
    return dict(sorted(out.items()))


def window(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    return {le: after[le] - before.get(le, 0.0) for le in after}


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile (0..1) of cumulative `buckets`; None if empty."""
    if not buckets:
        return None
    total = buckets.get(math.inf, max(buckets.values()))
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets.items():
        if count >= rank:
            if math.isinf(le):
                return lower  # past the last finite bound: report that bound
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def share_at_most(buckets: dict[float, float], bound: float) -> float | None:
    """Fraction of observations <= `bound` (`bound` should be a bucket edge)."""
    total = buckets.get(math.inf)
    if not total:
        return None
    edges = [le for le in buckets if le <= bound]
    return buckets[edges[-1]] / total if edges else 0.0


def count(buckets: dict[float, float]) -> int:
    return int(buckets.get(math.inf, 0))


def counter_totals(text: str, prefix: str) -> dict[str, float]:
    """name -> value summed over its label sets, for the counters whose name starts with
    `prefix` (a `_total` suffix, as prometheus_client writes counters, dropped)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or not m["name"].startswith(prefix) or m["name"].endswith("_created"):
            continue
        name = m["name"].removesuffix("_total")
        try:
            totals[name] = totals.get(name, 0.0) + float(m["value"])
        except ValueError:
            continue
    return totals
