"""Checkpoint gaps: how much forward lies between two checkpoints, measured always.

A cancel that lands while a step runs waits for the forward's next checkpoint, so the
gap between two consecutive checkpoints bounds that wait. `GapRecorder` is told when a
step starts (`start`), at each checkpoint (`mark`) and when the step ends (`end`), and
counts each gap (start to first checkpoint, checkpoint to checkpoint, last checkpoint
to the end of sampling) into fixed buckets. Reading it (`statistics`, `buckets`) never
blocks the writer.

One writer at a time (the thread or process that runs the forward), any number of
readers: the counts are one small int64 tensor, written through a numpy view (a few
hundred nanoseconds a mark), which `share_memory` moves to shared memory so that a model
worker process and the server can count into and read the same histogram.
"""

from __future__ import annotations

import bisect
import math
import time

import attrs
import numpy as np
import torch

#: Upper bounds of the buckets, in seconds (a last one, +Inf, takes the rest).
BOUNDS = (
    0.00025,
    0.0005,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
)
_BOUNDS_NS = [round(b * 1e9) for b in BOUNDS]
_SUM, _MAX = len(BOUNDS) + 1, len(BOUNDS) + 2  # slots after the buckets


@attrs.frozen
class GapStatistics:
    """Checkpoint gaps so far: p50 and p99 interpolated within their bucket (as
    Prometheus' `histogram_quantile` does), max and mean exact; seconds."""

    count: int
    p50: float | None
    p99: float | None
    max: float | None
    mean: float | None


class GapRecorder:
    def __init__(self) -> None:
        self._counts = torch.zeros(len(BOUNDS) + 3, dtype=torch.int64)
        self._view = self._counts.numpy()
        self._last: int | None = None  # perf_counter_ns of the last mark in this step

    def share_memory(self) -> None:
        """Move the counts to shared memory (before a worker process is given them)."""
        self._counts.share_memory_()
        self._view = self._counts.numpy()

    def __getstate__(self) -> dict[str, object]:
        return {"counts": self._counts}  # the tensor goes by shared memory when shared

    def __setstate__(self, state: dict[str, object]) -> None:
        self._counts = state["counts"]  # type: ignore[assignment]
        self._view = self._counts.numpy()
        self._last = None

    # -- the writer (the forward's thread or process) -----------------------------

    def start(self) -> None:
        self._last = time.perf_counter_ns()

    def mark(self) -> None:
        """A checkpoint: count the gap since the last mark (or the step's start)."""
        now = time.perf_counter_ns()
        if self._last is not None:
            gap = now - self._last
            view = self._view
            view[bisect.bisect_left(_BOUNDS_NS, gap)] += 1
            view[_SUM] += gap
            if gap > view[_MAX]:
                view[_MAX] = gap
        self._last = now

    def end(self) -> None:
        """The step ended (sampled, aborted or failed): count its last gap."""
        self.mark()
        self._last = None

    # -- readers ----------------------------------------------------------------------

    def buckets(self) -> tuple[list[tuple[float, int]], float]:
        """Cumulative (upper bound, count) pairs ending with +Inf, and the sum in seconds."""
        counts = self._view.copy()
        cumulative = np.cumsum(counts[: len(BOUNDS) + 1]).tolist()
        return list(zip([*BOUNDS, math.inf], cumulative, strict=True)), float(counts[_SUM]) / 1e9

    def statistics(self) -> GapStatistics:
        pairs, total_seconds = self.buckets()
        count = pairs[-1][1]
        if not count:
            return GapStatistics(0, None, None, None, None)
        return GapStatistics(
            count=count,
            p50=quantile(pairs, 0.5),
            p99=quantile(pairs, 0.99),
            max=int(self._view[_MAX]) / 1e9,
            mean=total_seconds / count,
        )


def quantile(pairs: list[tuple[float, int]], q: float) -> float:
    """The q-quantile of cumulative (upper bound, count) pairs with a nonzero total,
    interpolated linearly within its bucket; the last finite bound past it."""
    rank = q * pairs[-1][1]
    lower, below = 0.0, 0
    for bound, count in pairs:
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
