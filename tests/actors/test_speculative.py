"""Speculative decoding (n-gram prompt lookup): the proposer, the configuration as vLLM
writes it, and, on the real SmolLM2 model (where drafts are accepted), greedy outputs
equal to decoding without it: alone and batched, on both backends, beside cancelled
requests, within max_tokens, for rows that may not speculate, and with speculation
switched off by the batch's size.

Steps hold at most `DOT_ROWS` rows and prefill goes through the compiled kernel
(`kernel_prefill`), so every row is computed as it is alone: a request's tokens then do
not depend on what shares its steps, speculative rows included."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvscope.actors.speculation import INDEXED_PER_STEP, NgramIndex, RowDrafter, propose_ngram
from kvscope.config import EngineConfig, SpeculativeConfig
from kvscope.kernels.quantized import DOT_ROWS

from ..conftest import open_engine
from ..models.test_quantized_engine import beside_cancellations

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
STEP = {"max_num_batched_tokens": DOT_ROWS, "model_threads": 1}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
#: Prompts whose answers quote them, so that drafts from the prompt are accepted.
PROMPTS = [
    f"<|im_start|>user\nRepeat this code exactly:\n\n{CODE}<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSay 'one two three four' three times.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nCopy: the cat sat on the mat, the cat sat on the hat.<|im_end|>\n"
    "<|im_start|>assistant\n",
]


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 9, 8, 1, 2, 3], 2, [9, 8]),  # the longest suffix that occurs
        ([1, 2, 8, 3, 2, 9, 1, 2], 2, [8, 3]),  # [1, 2] before [2] alone
        ([1, 5, 1, 6, 1], 2, [6, 1]),  # the latest earlier occurrence
        ([1, 2, 1], 5, [2, 1]),  # fewer than k follow
        ([1, 2, 3, 4], 3, []),  # nothing recurs
        ([7], 3, []),
    ],
)
def test_ngram_proposals(tokens: list[int], k: int, expected: list[int]) -> None:
    assert propose_ngram(tokens, k, 1, 3) == expected


def test_a_long_row_is_indexed_over_several_steps_then_proposes_as_a_scan_would() -> None:
    rng = random.Random(5)
    row = [rng.randrange(50) for _ in range(int(2.5 * INDEXED_PER_STEP))]
    index = NgramIndex(1, 3)
    # Behind after one and two steps' share of the row: no draft, the row decodes as is.
    assert index.propose(row, 4) == [] and index.propose(row, 4) == []
    for grown in (row, row + [7], row + [7, 3]):  # caught up, then a token a step
        assert index.propose(grown, 4) == propose_ngram(grown, 4, 1, 3) != []


def test_a_row_drafts_less_while_its_drafts_are_cut_and_more_once_taken_whole() -> None:
    drafter = RowDrafter(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    row = [1, 2, 3, 4, 5, 6, 7, 1]  # [1] recurs: 2, 3, 4, ... follow it
    assert drafter.propose(row, 10) == [2, 3, 4, 5]  # num_speculative_tokens at first
    lengths = []
    for drafted, accepted in [(4, 0), (1, 1), (2, 2), (4, 1), (2, 2)]:
        drafter.verified(drafted, accepted)
        lengths.append(len(drafter.propose(row, 10)))
    assert lengths == [1, 2, 4, 2, 4]
    assert len(drafter.propose(row, 3)) == 3  # never past the room it is given


def test_the_config_as_vllm_writes_it() -> None:
    config = EngineConfig(speculative_config=json.dumps(NGRAM | {"prompt_lookup_min": 2}))
    assert config.speculative_config == SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2
    )
    assert SpeculativeConfig.parse({"num_speculative_tokens": 3}).method == "ngram"
    assert EngineConfig().speculative_config is None
    refusals = {
        '{"model": "draft-135m", "num_speculative_tokens": 3}': "draft model 'draft-135m'",
        '{"method": "eagle"}': "method eagle is not served",
        '{"method": "ngram", "lookahead": 3}': "unknown key(s): lookahead",
        '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}': "must not exceed",
        '{"num_speculative_tokens": 0}': "num_speculative_tokens",
        "ngram": "is not JSON",
    }
    for given, said in refusals.items():
        with pytest.raises(ValueError, match="speculative_config") as raised:
            EngineConfig(speculative_config=given)
        assert said in str(raised.value)


async def _generate(engine: Any, prompts: list[Any], **params: Any) -> list[tuple[Any, ...]]:
    """Each prompt's tokens (greedy unless `params` say) and finish reason, the prompts
    run at once."""
    results: list[tuple[Any, ...]] = [()] * len(prompts)

    async def one(index: int, prompt: Any) -> None:
        done = await engine.generate(prompt, **({"temperature": 0} | params))
        results[index] = (list(done.token_ids), done.finish_reason)

    async with anyio.create_task_group() as tg:
        for index, prompt in enumerate(prompts):
            tg.start_soon(one, index, prompt)
    return results


@pytest.fixture
def model(smollm2_gguf: Path, kernel_prefill: None) -> str:
    return str(smollm2_gguf)


@pytest.mark.anyio
@pytest.mark.parametrize("worker", ["thread", "process"])
async def test_greedy_tokens_as_without_speculation(model: str, worker: str) -> None:
    async with open_engine(model, worker=worker, **STEP) as engine:
        plain = [await _generate(engine, [p], max_tokens=48) for p in PROMPTS]
        steps_plain = engine.stats()["steps"]
    async with open_engine(model, worker=worker, speculative_config=NGRAM, **STEP) as engine:
        alone = [await _generate(engine, [p], max_tokens=48) for p in PROMPTS]
        stats = engine.stats()
        by_position = [engine.step_statistics().spec_accepted_per_position]
        batched = await _generate(engine, PROMPTS, max_tokens=48)
        short = await _generate(engine, PROMPTS[:1], max_tokens=7)  # ends inside a draft
    assert alone == plain
    assert batched == [result for [result] in plain]
    assert short == [(plain[0][0][0][:7], "length")]
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    per_position = by_position[0]  # a token is accepted only after those before it
    assert sum(per_position) == stats["spec_decode_num_accepted_tokens"]
    assert list(per_position) == sorted(per_position, reverse=True)
    # Accepted tokens come without a step of their own.
    assert stats["steps"] <= steps_plain - stats["spec_decode_num_accepted_tokens"] + 2


@pytest.mark.anyio
async def test_cancelled_rows_beside_speculating_ones(model: str) -> None:
    """Requests cancelled while drafts are verified beside them leave no block behind
    (the engine checks on close), and the others draw what they draw alone."""
    async with open_engine(model, **STEP) as engine:
        ids_list = [engine.tokenizer.encode(p) for p in PROMPTS]
        expected = [
            (await _generate(engine, [ids], max_tokens=40, ignore_eos=True))[0][0]
            for ids in ids_list
        ]
    async with open_engine(model, speculative_config=NGRAM, **STEP) as engine:
        tokens, reasons = await beside_cancellations(engine, ids_list, 40)
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert reasons == ["cancelled", "cancelled"]
    assert tokens == expected


@pytest.mark.anyio
async def test_rows_that_may_not_speculate_decode_one_token_a_step(model: str) -> None:
    async with open_engine(model, **STEP) as engine:
        plain = await engine.generate(PROMPTS[0], temperature=0, max_tokens=24, logprobs=1)
    async with open_engine(model, speculative_config=NGRAM, **STEP) as engine:
        scored = await engine.generate(PROMPTS[0], temperature=0, max_tokens=24, logprobs=1)
        penalized = await engine.generate(
            PROMPTS[0], temperature=0, max_tokens=24, repetition_penalty=1.1
        )
        assert engine.stats()["spec_decode_num_drafts"] == 0
    assert scored.token_ids == plain.token_ids
    assert len(penalized.token_ids) == 24


@pytest.mark.anyio
async def test_a_seeded_sampled_row_draws_as_without_speculation(model: str) -> None:
    """Sampled rows speculate too, drawing one number a token from their generator as
    decoding does (their distribution is tested in tests/kernels/test_speculative.py):
    a seeded request draws the tokens it draws without speculation, batched or not."""
    sampled = {"temperature": 0.7, "top_p": 0.95, "seed": 7, "max_tokens": 40}
    async with open_engine(model, **STEP) as engine:
        plain = await _generate(engine, PROMPTS[:1], **sampled)
    async with open_engine(model, speculative_config=NGRAM, **STEP) as engine:
        alone = await _generate(engine, PROMPTS[:1], **sampled)
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
        batched = await _generate(engine, PROMPTS, **sampled)
    assert alone == plain
    assert batched[0] == plain[0]


@pytest.mark.anyio
async def test_a_batch_over_disable_by_batch_size_does_not_speculate(model: str) -> None:
    config = NGRAM | {"disable_by_batch_size": 1}
    # A step takes a prompt whole: the second starts a step after the first at most,
    # and has no token to draft once the first has ended.
    budget = {"max_num_batched_tokens": 256, "model_threads": 1}
    async with open_engine(model, speculative_config=config, **budget) as engine:
        await _generate(engine, [PROMPTS[0]] * 2, max_tokens=24, ignore_eos=True)
        assert engine.stats()["spec_decode_num_drafts"] == 0
        await _generate(engine, [PROMPTS[0]], max_tokens=24, ignore_eos=True)
        assert engine.stats()["spec_decode_num_drafts"] > 0
