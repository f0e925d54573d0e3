"""The sampling fields beyond temperature/top-k/top-p through the Python API, on both
backends: logprobs follow the tokens in every delta, a ban and the penalties change the
greedy path, and a seeded penalized request gives the same tokens alone or batched."""

from __future__ import annotations

import anyio
import pytest

from kvscope import Engine, InvalidRequest, SamplingParams

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0, "ignore_eos": True}


async def test_logprobs_come_with_each_token(engine: Engine):
    async with engine.request(
        "Hello there", SamplingParams(max_tokens=6, logprobs=3, **GREEDY)
    ) as req:
        deltas = [delta async for delta in req]
    result = req.result
    assert result.logprobs is not None and len(result.logprobs) == 6
    assert [lp for d in deltas for lp in d.logprobs] == list(result.logprobs)
    for token, lp in zip(result.token_ids, result.logprobs, strict=True):
        # Greedy: the chosen token is the most likely one, first of the top 3.
        assert len(lp.top) == 3 and lp.top[0] == (token, lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    plain = await engine.generate("Hello there", max_tokens=6, **GREEDY)
    assert plain.logprobs is None and plain.token_ids == result.token_ids


async def test_a_ban_and_the_penalties_change_the_greedy_path(engine: Engine):
    plain = await engine.generate("abcabcabc", max_tokens=12, **GREEDY)
    first = plain.token_ids[0]
    banned = await engine.generate("abcabcabc", max_tokens=12, logit_bias={first: -100}, **GREEDY)
    assert first not in banned.token_ids
    penalized = await engine.generate(
        "abcabcabc", max_tokens=12, presence_penalty=-2.0, frequency_penalty=-2.0, **GREEDY
    )
    # The random model's plain path never repeats a token; negative penalties (a pull
    # towards tokens already out) make it repeat. Exact values by hand: test_sampling.py
    # and tests/web/test_openai_sampling.py.
    assert len(set(plain.token_ids)) == 12 and len(set(penalized.token_ids)) < 12


async def test_seeded_penalized_sampling_is_the_same_alone_and_batched(engine: Engine):
    fields = dict(max_tokens=10, seed=11, repetition_penalty=1.3, logit_bias={5: 3}, logprobs=1)
    alone = await engine.generate("seeded", **fields)
    results: dict[int, object] = {}

    async def one(i: int, prompt: str, more: dict) -> None:
        results[i] = await engine.generate(prompt, **more)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0, "seeded", fields)
        for i in range(1, 4):
            tg.start_soon(one, i, f"other {i}", {"max_tokens": 10, "frequency_penalty": 1.0})
    assert results[0].token_ids == alone.token_ids  # type: ignore[attr-defined]
    batched = [lp.logprob for lp in results[0].logprobs]  # type: ignore[attr-defined]
    assert batched == pytest.approx([lp.logprob for lp in alone.logprobs], abs=1e-4)


async def test_min_tokens_holds_back_the_end(engine: Engine):
    eos = engine.tokenizer.eos_token_ids[0]
    out = await engine.generate(
        "x", max_tokens=6, min_tokens=4, logit_bias={eos: 100}, temperature=0
    )
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and out.finish_reason == "stop"


async def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(engine: Engine):
    with pytest.raises(InvalidRequest, match="logit_bias"):
        await engine.generate("x", logit_bias={10_000: 1})
    with pytest.raises(InvalidRequest, match="min_tokens"):
        await engine.generate("x", max_tokens=2, min_tokens=3)


async def test_structured_output_through_the_python_api(engine: Engine):
    out = await engine.generate("pick", guided_choice=["alpha", "beta"], max_tokens=10, seed=3)
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    out = await engine.generate("n", guided_regex="[0-9]{4}", max_tokens=10, temperature=0)
    assert len(out.text) == 4 and out.text.isdigit()
    with pytest.raises(InvalidRequest, match="guided_json"):
        await engine.generate("x", guided_json={"type": "no-such-type"})
