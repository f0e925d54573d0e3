"""The checkpoint-gap histogram: every gap counted once, quantiles within their
bucket, and one histogram shared by a process that counts and one that reads."""

from __future__ import annotations

import math
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

from kvscope.execution.gaps import BOUNDS, GapRecorder, quantile


def test_a_step_of_n_checkpoints_counts_n_plus_one_gaps():
    gaps = GapRecorder()
    assert gaps.statistics().count == 0 and gaps.statistics().p99 is None
    for _ in range(2):
        gaps.start()
        for _ in range(5):
            gaps.mark()
        gaps.end()
    stats = gaps.statistics()
    assert stats.count == 12
    assert stats.max is not None and stats.p50 is not None and stats.p99 is not None
    assert 0 <= stats.p50 <= stats.p99 <= max(stats.max, BOUNDS[0])
    pairs, total = gaps.buckets()
    assert pairs[-1] == (math.inf, 12) and total >= 0
    assert [c for _, c in pairs] == sorted(c for _, c in pairs)  # cumulative


def test_an_end_without_a_start_counts_nothing():
    gaps = GapRecorder()
    gaps.end()
    assert gaps.statistics().count == 0


def test_quantile_interpolates_within_the_bucket():
    # 10 gaps under 1 ms, 10 more between 1 and 2 ms
    pairs = [(0.001, 10), (0.002, 20), (math.inf, 20)]
    assert quantile(pairs, 0.5) == pytest.approx(0.001)
    assert quantile(pairs, 0.75) == pytest.approx(0.0015)
    assert quantile([(0.001, 0), (math.inf, 4)], 0.99) == 0.001  # past the last bound


def test_a_shared_recorder_counts_into_one_histogram():
    gaps = GapRecorder()
    gaps.share_memory()
    # what a spawned worker receives: the same shared tensor, not a copy
    twin = pickle.loads(ForkingPickler.dumps(gaps))
    twin.start()
    twin.mark()
    twin.end()
    assert gaps.statistics().count == 2
