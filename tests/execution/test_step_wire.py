"""The wire format between the engine and its model worker (`execution/step_wire.py`): a
step crosses the pipe (a real pickle, as `Connection` sends it) and comes back the same,
each request's parameters cross once and are forgotten on both sides when no step has
used them for a while, and the answer keeps every token, log-probability (the prompt's
too) and generator state."""

from __future__ import annotations

import pickle

import pytest
import torch

from kvscope.execution.step_input import ChunkInput, StepInput
from kvscope.execution.step_wire import (
    FORGET_AFTER,
    FORGET_EVERY,
    StepDecoder,
    StepEncoder,
    decode_answer,
    encode_answer,
)
from kvscope.kernels.sampling import Sampled, TokenLogprobs
from kvscope.models.llama import StepAborted
from kvscope.params import SamplingParams


def _chunk(params: SamplingParams, *, start: int = 40, seed: int | None = None) -> ChunkInput:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return ChunkInput([5, 6], start, [3, 9, 4], True, params, generator)


def _cross(encoder: StepEncoder, decoder: StepDecoder, step: StepInput) -> StepInput:
    return decoder.decode(pickle.loads(pickle.dumps(encoder.encode(step))))


def test_a_step_crosses_unchanged():
    greedy = SamplingParams(max_tokens=7, temperature=0.0)
    sampled = SamplingParams(max_tokens=9, temperature=0.8, top_k=5, seed=3)
    step = StepInput([_chunk(greedy), _chunk(sampled, start=0, seed=11)], [(1, 2)])
    got = _cross(StepEncoder(), StepDecoder(), step)
    assert got.copies == [(1, 2)]
    for sent, came in zip(step.chunks, got.chunks, strict=True):
        assert (came.token_ids, came.start, came.block_table, came.sample) == (
            sent.token_ids,
            sent.start,
            sent.block_table,
            sent.sample,
        )
        assert came.params == sent.params and came.state is None
    assert got.chunks[0].generator is None
    drawn = got.chunks[1].generator
    assert drawn is not None and drawn is not step.chunks[1].generator
    assert torch.equal(drawn.get_state(), step.chunks[1].generator.get_state())


def test_each_requests_parameters_cross_once():
    encoder, decoder = StepEncoder(), StepDecoder()
    first, second = SamplingParams(max_tokens=3), SamplingParams(max_tokens=3)
    message = encoder.encode(StepInput([_chunk(first), _chunk(second)], []))
    assert sorted(p.max_tokens for p in message[2].values()) == [3, 3]  # equal, still two
    decoder.decode(message)
    again = encoder.encode(StepInput([_chunk(first), _chunk(second)], []))
    assert again[2] == {}
    assert [c.params for c in decoder.decode(again).chunks] == [first, second]
    assert encoder.held == decoder.held == 2


def test_parameters_unused_for_a_while_are_forgotten_and_sent_again():
    encoder, decoder = StepEncoder(), StepDecoder()
    stays, leaves = SamplingParams(max_tokens=4), SamplingParams(max_tokens=5)
    _cross(encoder, decoder, StepInput([_chunk(stays), _chunk(leaves)], []))
    for _ in range(FORGET_AFTER + FORGET_EVERY):
        _cross(encoder, decoder, StepInput([_chunk(stays)], []))
    assert encoder.held == decoder.held == 1
    back = encoder.encode(StepInput([_chunk(leaves)], []))
    assert list(back[2].values()) == [leaves]  # it comes back: sent again
    assert decoder.decode(back).chunks[0].params == leaves


def test_the_answer_keeps_tokens_logprobs_and_generator_states():
    params = SamplingParams(max_tokens=4, temperature=1.0, logprobs=1)
    step = StepInput([_chunk(params, seed=1), _chunk(params), _chunk(params, seed=2)], [])
    worker_step = _cross(StepEncoder(), StepDecoder(), step)
    worker_gen = worker_step.chunks[0].generator
    assert worker_gen is not None
    torch.rand(5, generator=worker_gen)  # the worker draws: its copy's state moves on
    lp = TokenLogprobs(-0.5, ((7, -0.5),))
    tokens: list[Sampled | None] = [Sampled(7, lp), None, Sampled(0)]
    answer = pickle.loads(pickle.dumps(encode_answer(tokens, worker_step)))
    assert decode_answer(step, answer) == tokens
    ours = step.chunks[0].generator
    assert ours is not None and torch.equal(ours.get_state(), worker_gen.get_state())


def test_an_aborted_or_failed_step_raises():
    step = StepInput([_chunk(SamplingParams())], [])
    with pytest.raises(StepAborted):
        decode_answer(step, ("aborted",))
    with pytest.raises(RuntimeError, match="model worker: boom"):
        decode_answer(step, ("error", "boom"))


def test_prompt_scores_cross_both_ways():
    """A chunk's `prompt_targets` reach the worker; the scores come back on a chunk
    that samples and on one that does not (its token None)."""
    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    scoring = ChunkInput([5, 6, 7], 0, [3], False, params, None, None, [6, 7, 8])
    step = StepInput([_chunk(params), scoring], [])
    worker_step = _cross(StepEncoder(), StepDecoder(), step)
    assert [c.prompt_targets for c in worker_step.chunks] == [[], [6, 7, 8]]
    scores = tuple(TokenLogprobs(-float(i), ((1, -0.1),)) for i in range(3))
    tokens: list[Sampled | None] = [Sampled(4, None, scores[:1]), Sampled(None, None, scores)]
    answer = pickle.loads(pickle.dumps(encode_answer(tokens, worker_step)))
    assert decode_answer(step, answer) == tokens
