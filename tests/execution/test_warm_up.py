"""The warm-up (`execution/warm_up.py`): a step for each row bucket on a scratch cache,
run all at once or one at a time, stopped by its control and taken up again."""

from __future__ import annotations

import pytest
import torch

from kvscope.execution import warm_up as warm_up_module
from kvscope.execution.step_input import StepControl, StepInput
from kvscope.execution.warm_up import WarmUp, warm_up_now
from kvscope.kernels.linear import row_buckets

from .test_runner import chunks, make_runner


def bucketed_runner():
    """A bfloat16 runner whose linears run at row buckets (oneDNN's prepacked layout)."""
    runner = make_runner(torch.bfloat16)
    if not any(linear.in_buckets for linear in runner.model.linears()):
        pytest.skip("this CPU has no prepacked oneDNN layout: nothing runs at row buckets")
    return runner


def test_the_warm_up_leaves_the_cache_and_the_gaps_alone():
    """The warm-up runs full steps' rows on a scratch cache: the shared cache keeps its
    contents, the checkpoint-gap histogram counts nothing, and the runner's steps give
    the tokens they gave before it."""
    runner = bucketed_runner()
    before = runner.execute(StepInput(chunks(), []), StepControl())
    kv = runner.kv_cache
    for cache in (*kv.keys, *kv.values):
        cache.fill_(0.5)
    snapshot = [t.clone() for t in (*kv.keys, *kv.values)]
    gaps_before = runner.gaps.statistics().count
    warm_up_now(runner, 600)  # a step per row bucket up to 600 rows
    assert runner.kv_cache is kv
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (*kv.keys, *kv.values), strict=True))
    assert runner.gaps.statistics().count == gaps_before
    assert runner.execute(StepInput(chunks(), []), StepControl()) == before


def test_the_warm_up_builds_every_row_bucket_up_to_its_cap(caplog, monkeypatch):
    """One step per row bucket, up to `WARM_UP_MOST_ROWS` rows however big the budget
    asked for, smallest first, and a log line that says so."""
    monkeypatch.setattr(warm_up_module, "WARM_UP_MOST_ROWS", 300)
    warm_up = WarmUp(bucketed_runner(), 10_000)
    buckets = row_buckets(300)
    assert warm_up.pending == buckets
    with caplog.at_level("INFO", logger="kvscope.execution.warm_up"):
        while not warm_up.done:
            assert warm_up.run_next(StepControl())
    assert warm_up.built == buckets
    assert f"warmed up {len(buckets)} row counts (up to {buckets[-1]} rows)" in caplog.text


def test_a_stopped_warm_up_step_stays_pending_and_is_run_again():
    """A warm-up step whose control is aborted (a request arrived) stops at a
    checkpoint, and its bucket is the next one run."""
    warm_up = WarmUp(bucketed_runner(), 64)
    first = warm_up.pending[0]
    stopped = StepControl()
    stopped.abort.set()
    assert not warm_up.run_next(stopped)
    assert warm_up.pending[0] == first and warm_up.built == []
    assert warm_up.run_next(StepControl())
    assert warm_up.built == [first]


def test_a_model_without_bucketed_linears_has_nothing_to_warm_up():
    """float32 linears go through `F.linear`, which builds nothing per row count."""
    runner = make_runner(torch.float32)
    assert not any(linear.in_buckets for linear in runner.model.linears())
    assert WarmUp(runner, 1536).done
