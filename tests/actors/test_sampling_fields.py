"""The sampling fields beyond temperature/top-k/top-p through the Python API, on both
backends: logprobs follow the tokens in every delta, prompt logprobs score every prompt
token however it was computed, a ban and the penalties change the greedy path, and a
seeded penalized request gives the same tokens alone or batched."""

from __future__ import annotations

import threading

import anyio
import pytest

from kvscope import Engine, InvalidRequest, SamplingParams
from kvscope.actors.bad_words import bad_word_ids
from tests.conftest import audit_lines, open_engine, wait_for

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


async def prompt_scores(engine: Engine, prompt: list[int], **options: object) -> list[float | None]:
    out = await engine.generate(prompt, max_tokens=2, prompt_logprobs=2, **GREEDY, **options)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None  # nothing predicts the first token
    for lp in out.prompt_logprobs[1:]:
        assert lp is not None and len(lp.top) == 2
        assert lp.top[0][1] >= lp.top[1][1] and lp.top[0][1] >= lp.logprob
    return [lp.logprob if lp is not None else None for lp in out.prompt_logprobs]


@pytest.mark.parametrize("worker", ["thread", "process"])
async def test_prompt_logprobs_score_every_prompt_token_whatever_was_cached(worker: str):
    """Each prompt token's log-probability given those before it: the same in one
    prefill step as in chunks of 3, after the prompt's blocks entered the prefix cache
    (a scoring request takes no cached prefix), and for each of `n` samples (which
    share no sibling's prompt); its first token's delta carries them."""
    async with open_engine(worker=worker, block_size=4, max_num_batched_tokens=64) as engine:
        if worker == "process":  # else the first steps may run in the engine's own thread
            await wait_for(lambda: engine.stats()["worker_pid"] > 0, 60, "the worker ready")
        prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog again")
        assert len(prompt) > 12
        whole = await prompt_scores(engine, prompt)
        reused = engine.stats()["prompt_tokens_reused"]
        assert await prompt_scores(engine, prompt) == pytest.approx(whole, abs=1e-5)
        assert engine.stats()["prompt_tokens_reused"] == reused  # the cache was not read
        samples = await engine.submit_samples(
            prompt, n=2, max_tokens=2, prompt_logprobs=0, temperature=1.0, seed=5
        )
        for sample in [await job.wait() for job in samples]:
            assert sample.prompt_logprobs is not None
            assert [lp.logprob for lp in sample.prompt_logprobs[1:]] == pytest.approx(
                whole[1:], abs=1e-5
            )
            assert all(lp.top == () for lp in sample.prompt_logprobs[1:])
        async with engine.request(prompt, max_tokens=3, prompt_logprobs=1, **GREEDY) as req:
            deltas = [delta async for delta in req]
        assert deltas[0].prompt_logprobs == req.result.prompt_logprobs
        assert all(delta.prompt_logprobs is None for delta in deltas[1:])
    async with open_engine(worker=worker, block_size=4, max_num_batched_tokens=3) as engine:
        assert await prompt_scores(engine, prompt) == pytest.approx(whole, abs=1e-4)


async def test_a_request_cancelled_mid_prompt_keeps_the_scores_it_had():
    """Cancelled while its second prefill chunk is held before the forward: the first
    chunk's tokens keep their scores, the rest are None; its blocks are released at
    the cancel, one audit line says so, and nothing leaks (open_engine)."""
    async with open_engine(block_size=4, max_num_batched_tokens=4) as engine:
        second, release, calls = threading.Event(), threading.Event(), []

        def hold() -> None:
            calls.append(None)
            if len(calls) == 2:
                second.set()
                release.wait(30)

        engine.before_forward.append(hold)
        prompt = engine.tokenizer.encode("one two three four five six seven eight nine ten")
        job = await engine.submit(prompt, max_tokens=4, prompt_logprobs=0, **GREEDY)
        assert await anyio.to_thread.run_sync(second.wait, 10), "no second chunk"
        report = await engine.cancel(job.id)
        release.set()
        result = await job.wait()
        [line] = audit_lines(engine, job.id)
    assert report.found and report.blocks_released > 0 and report.in_running_step
    assert line["finish_reason"] == "cancelled" and line["released"] is not None
    assert result.finish_reason == "cancelled" and result.prompt_logprobs is not None
    scored = [lp is not None for lp in result.prompt_logprobs]
    assert scored == [False] + [True] * 4 + [False] * (len(prompt) - 5)


async def test_a_long_prompt_is_scored_alike_in_one_step_and_in_chunks():
    """600 prompt tokens in one prefill step (scored a few hundred rows at a time) and
    in chunks of 64: the same scores."""
    prompt = list(range(1, 256)) * 2 + list(range(1, 91))
    scores = []
    for budget in (1024, 64):
        async with open_engine(max_num_batched_tokens=budget) as engine:
            scores.append(await prompt_scores(engine, prompt))
    assert len(scores[0]) == 600 and scores[0][1:] == pytest.approx(scores[1][1:], abs=1e-4)


async def test_bad_words_keep_a_word_the_model_writes_out_of_its_output() -> None:
    async with open_engine("bundled") as engine:
        prompt = "def fibonacci(n):"
        before = await engine.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
        pieces = [engine.tokenizer.decode([t]) for t in before.token_ids]
        word = next(p.strip() for p in pieces if p.strip().isalpha() and len(p.strip()) > 1)
        sequences = bad_word_ids(engine.tokenizer, (word,))
        assert any(_holds(before.token_ids, s) for s in sequences)
        after = await engine.generate(
            prompt, max_tokens=24, temperature=0, ignore_eos=True, bad_words=[word]
        )
        assert not any(_holds(after.token_ids, s) for s in sequences)
        assert after.token_ids != before.token_ids


def _holds(tokens: tuple[int, ...], sequence: tuple[int, ...]) -> bool:
    n = len(sequence)
    return any(tokens[i : i + n] == sequence for i in range(len(tokens) - n + 1))
