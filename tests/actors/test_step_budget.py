"""The step's time budget: the fit of step times, the prefill tokens it allows, and the
scheduler bounding prefill chunks (never decode rows) by it."""

from __future__ import annotations

import pytest

from kvscope.actors.sequence import Sequence
from kvscope.actors.step_budget import StepTimeBudget

from .test_scheduler import make, run_step


def test_it_learns_fixed_and_per_token_costs_and_bounds_prefill():
    budget = StepTimeBudget(0.05, floor=4)
    assert budget.prefill_tokens(8, 512) == 512  # nothing learned yet: no bound
    for tokens in (40, 200, 72, 520, 136):
        budget.observe(0.010 + 0.0002 * tokens, tokens)
    fixed, per_token = budget.fit()  # type: ignore[misc]
    assert fixed == pytest.approx(0.010) and per_token == pytest.approx(0.0002)
    # (0.05 - 0.010) / 0.0002 = 200 tokens in all, 8 of them decode rows
    assert budget.prefill_tokens(8, 512) == 192
    assert budget.prefill_tokens(8, 100) == 100  # the token budget still caps it
    assert budget.prefill_tokens(500, 512) == 4  # never below the floor


def test_steps_of_one_size_or_no_bound_leave_the_token_budget_alone():
    same = StepTimeBudget(0.05)
    for _ in range(5):
        same.observe(0.1, 64)
    assert same.fit() is None and same.prefill_tokens(0, 512) == 512
    off = StepTimeBudget(0.0)
    for tokens in (10, 100):
        off.observe(0.001 * tokens, tokens)
    assert off.prefill_tokens(0, 512) == 512


def test_the_scheduler_bounds_prefill_chunks_by_time_not_decode_rows():
    _, sched = make(num_blocks=64, budget=64)
    sched.step_budget = StepTimeBudget(0.010, floor=4)
    for tokens in (10, 40):
        sched.step_budget.observe(0.001 * tokens, tokens)  # 1 ms a token, no fixed cost
    decoders = [Sequence(f"d{i}", [1, 2]) for i in range(3)]
    for seq in decoders:
        sched.add(seq)
    run_step(sched)  # their 2-token prompts: prefill chunks within the 10 tokens
    long = Sequence("long", list(range(40)))
    sched.add(long)
    step = run_step(sched)
    # 3 decode rows, then 10 - 3 = 7 prefill tokens of the long prompt
    assert [(s.id, n) for s, n in step.chunks] == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 7)]
    step = run_step(sched)
    assert [(s.id, n) for s, n in step.chunks][-1] == ("long", 7)
