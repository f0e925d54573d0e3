"""The Python API of DESIGN section 3 on both anyio backends: streaming deltas, one-shot
generation, detached jobs, sampling and stop conditions, validation, stats."""

from __future__ import annotations

import os

import anyio
import pytest

from kvscope import (
    Engine,
    EngineClosed,
    InvalidRequest,
    RequestConflict,
    SamplingParams,
    UnknownRequest,
)
from tests.conftest import audit_lines, open_engine

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0, "ignore_eos": True}


async def test_streamed_deltas_add_up_to_the_result(engine: Engine):
    async with engine.request(
        "Once upon a time", SamplingParams(max_tokens=24, **GREEDY)
    ) as request:
        deltas = [delta async for delta in request]
    result = request.result
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 24
    assert [t for d in deltas for t in d.token_ids] == list(result.token_ids)
    assert "".join(d.text for d in deltas) == result.text
    assert result.prompt_tokens == len(engine.tokenizer.encode("Once upon a time"))
    assert len(audit_lines(engine, result.id)) == 1


async def test_generate_submit_and_token_id_prompts_agree(engine: Engine):
    ids = engine.tokenizer.encode("same prompt")
    one = await engine.generate("same prompt", max_tokens=16, **GREEDY)
    two = await (await engine.submit(ids, max_tokens=16, **GREEDY)).wait()
    assert one.token_ids == two.token_ids and one.text == two.text


async def test_seeded_sampling_repeats_and_seeds_differ(engine: Engine):
    params = {"max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "ignore_eos": True}
    a = await engine.generate("seeded", seed=7, **params)
    b = await engine.generate("seeded", seed=7, **params)
    c = await engine.generate("seeded", seed=8, **params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


async def test_seeded_sampling_is_the_same_alone_and_batched(engine: Engine):
    params = {"max_tokens": 12, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    alone = await engine.generate("batch me", **params)
    results = {}
    async with anyio.create_task_group() as tg:
        for i in range(4):

            async def run(i: int = i) -> None:
                results[i] = await engine.generate("batch me" if i == 0 else f"noise {i}", **params)

            tg.start_soon(run)
    assert results[0].token_ids == alone.token_ids


async def test_stop_token_ids_and_eos(engine: Engine):
    free = await engine.generate("stops", max_tokens=30, **GREEDY)
    stop_at = free.token_ids[5]
    stopped = await engine.generate("stops", max_tokens=30, temperature=0, stop_token_ids=[stop_at])
    first = free.token_ids.index(stop_at)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


def printable_pair(text: str) -> str:
    """Two printable characters from inside `text`, to stop on."""
    candidates = [text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].isprintable()]
    if not candidates:
        pytest.skip("the random model produced no printable pair to stop on")
    return candidates[0]


async def test_stop_strings_truncate_the_text(engine: Engine):
    free = await engine.generate("ascii please", max_tokens=40, **GREEDY)
    text = free.text
    stop = printable_pair(text)
    async with engine.request("ascii please", max_tokens=40, stop=[stop], **GREEDY) as request:
        streamed = "".join([d.text async for d in request])
    result = request.result
    assert result.finish_reason == "stop"
    assert result.text == text[: text.index(stop)]
    assert streamed == result.text  # the held-back stop string never reached the stream


async def test_a_stop_kept_in_the_text_on_request(engine: Engine):
    """vLLM's `include_stop_str_in_output`: the stop string (or stop token) that ended
    the text stays in it, streamed and whole."""
    free = await engine.generate("ascii please", max_tokens=40, **GREEDY)
    text = free.text
    stop = printable_pair(text)
    kept = {"stop": [stop], "include_stop_str_in_output": True}
    async with engine.request("ascii please", max_tokens=40, **kept, **GREEDY) as request:
        streamed = "".join([d.text async for d in request])
    assert request.result.text == streamed == text[: text.index(stop) + len(stop)]
    stop_at = free.token_ids[5]
    by_token = await engine.generate(
        "ascii please",
        max_tokens=40,
        stop_token_ids=[stop_at],
        include_stop_str_in_output=True,
        **GREEDY,
    )
    first = free.token_ids.index(stop_at)
    assert by_token.text == engine.tokenizer.decode(list(free.token_ids[: first + 1]))


async def test_special_tokens_show_their_text_on_request():
    """vLLM's `skip_special_tokens=False`, on the bundled model's tokenizer: the EOS that
    ended the text shows as `</s>` (kept with `include_stop_str_in_output`)."""
    async with open_engine("bundled") as engine:
        eos = engine.tokenizer.eos_token_ids[0]
        forced = {"max_tokens": 4, "temperature": 0, "logit_bias": {eos: 100}}
        hidden = await engine.generate("x", include_stop_str_in_output=True, **forced)
        shown = await engine.generate(
            "x", include_stop_str_in_output=True, skip_special_tokens=False, **forced
        )
    assert hidden.token_ids == shown.token_ids == (eos,)
    assert (
        hidden.text == ""
        and shown.text == engine.tokenizer.decode([eos], skip_special_tokens=False) != ""
    )


async def test_max_tokens_is_capped_to_the_context():
    async with open_engine(max_model_len=64) as engine:
        result = await engine.generate(list(range(1, 60)), max_tokens=1000, **GREEDY)
        assert result.finish_reason == "length" and len(result.token_ids) == 5
        with pytest.raises(InvalidRequest, match="context"):
            await engine.generate(list(range(1, 70)))


async def test_the_context_policy_refuses_or_caps():
    """`context="refuse"` (the OpenAI routes') refuses what "cap" (the default) cuts
    to the context's end; `engine.fit` says which, by the same rule."""
    async with open_engine(max_model_len=64) as engine:
        prompt = list(range(1, 60))
        assert engine.fit(59, 1000) == 5 and engine.fit(59, 5, "refuse") == 5
        with pytest.raises(InvalidRequest, match="maximum context length is 64") as caught:
            await engine.generate(prompt, max_tokens=6, context="refuse")
        assert caught.value.field == "max_tokens" and "65 tokens" in str(caught.value)
        with pytest.raises(InvalidRequest) as caught:
            engine.fit(59, 6, "refuse")
        assert caught.value.field == "max_tokens"
        done = await engine.generate(prompt, max_tokens=5, context="refuse", **GREEDY)
        assert len(done.token_ids) == 5
        with pytest.raises(InvalidRequest) as caught:
            await engine.generate(prompt, context="always")
        assert caught.value.field == "context"
        # An embedding needs no room after its prompt: the whole context is its own.
        embedded = await engine.generate(list(range(1, 65)), embed=True, context="refuse")
        assert embedded.finish_reason == "stop"
        assert engine.stats()["live_requests"] == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"nonsense": 1},
        {"timeout": -1},
        {"timeout": 0},
        {"timeout": 10**9},  # beyond params.TIMEOUT, as over HTTP
        {"priority": "high"},
        {"priority": 1.5},
        {"priority": 2**40},  # beyond params.PRIORITY, as over HTTP
    ],
)
async def test_invalid_requests_raise_invalid_request(engine: Engine, bad: dict):
    with pytest.raises(InvalidRequest):
        await engine.generate("x", **bad)
    assert engine.stats()["live_requests"] == 0


@pytest.mark.parametrize(
    "prompt", ["", [], [1, 99999], b"x", [1.5], [1, True], [-1, 2], [2, "3"], [2, None]]
)
async def test_bad_prompts_are_rejected(engine: Engine, prompt: object):
    with pytest.raises(InvalidRequest):
        await engine.generate(prompt)  # type: ignore[arg-type]


async def test_unknown_or_ended_parent_and_duplicate_ids(engine: Engine):
    with pytest.raises(UnknownRequest):
        await engine.submit("orphan", parent="req-missing")
    done = await engine.generate("done", max_tokens=2, **GREEDY)
    with pytest.raises(RequestConflict):
        await engine.submit("late child", parent=done.id)
    job = await engine.submit("named", request_id="mine", max_tokens=2, **GREEDY)
    with pytest.raises(RequestConflict):
        await engine.submit("named", request_id="mine")
    await job.wait()


async def test_one_id_submitted_twice_at_once_is_one_request_and_one_conflict(engine: Engine):
    # The second submit runs while the first one's task has yet to start: the id must
    # already be taken then (it was an ExceptionGroup out of the task).
    outcomes: list[str] = []

    async def submit() -> None:
        try:
            job = await engine.submit("twins", request_id="twin", max_tokens=2, **GREEDY)
        except RequestConflict:
            outcomes.append("conflict")
        else:
            await job.wait()
            outcomes.append("ran")

    async with anyio.create_task_group() as tg:
        tg.start_soon(submit)
        tg.start_soon(submit)
    assert sorted(outcomes) == ["conflict", "ran"]
    assert [line["id"] for line in engine.audit_records()].count("twin") == 1


async def test_watchers_see_the_whole_stream_and_cancel_nothing(engine: Engine):
    job = await engine.submit("watched", max_tokens=20, **GREEDY)
    with anyio.CancelScope() as scope:
        async for _ in engine.watch(job.id):
            scope.cancel()  # a watcher leaving early
    seen = [d async for d in engine.watch(job.id)]
    result = await job.wait()
    assert result.finish_reason == "length"
    assert [t for d in seen for t in d.token_ids] == list(result.token_ids)
    with pytest.raises(UnknownRequest):
        engine.watch("req-missing")


async def test_stats_and_request_info(engine: Engine):
    job = await engine.submit("info", max_tokens=4, priority=3, owner="key-a", **GREEDY)
    assert [i.id for i in engine.list_requests(owner="key-a")] == [job.id]
    assert engine.list_requests(owner="key-b") == []
    result = await job.wait()
    info = engine.get(job.id)
    assert info.status == "finished" and info.priority == 3 and info.owner == "key-a"
    assert info.as_dict()["tokens_generated"] == len(result.token_ids) == 4
    stats = engine.stats()
    for key in (
        "kv_blocks_total",
        "kv_blocks_free",
        "kv_blocks_in_use",
        "kv_blocks_cached",
        "running",
        "waiting",
        "finished",
        "cancelled",
        "failed",
    ):
        assert key in stats
    assert (
        stats["kv_blocks_free"] + stats["kv_blocks_in_use"] + stats["kv_blocks_cached"]
        == stats["kv_blocks_total"]
    )
    assert stats["finished"] >= 1


async def test_a_closed_engine_refuses_requests():
    async with open_engine() as engine:
        pass
    with pytest.raises(EngineClosed):
        await engine.submit("too late")


async def test_an_exception_in_the_engine_block_comes_out_unwrapped():
    with pytest.raises(KeyError):
        async with open_engine() as engine:
            await engine.submit("running", max_tokens=100, **GREEDY)
            raise KeyError("mine")


async def test_drain_waits_for_live_requests_and_stops_accepting():
    async with open_engine() as engine:
        job = await engine.submit("drain", max_tokens=10, **GREEDY)
        assert await engine.drain(timeout=30)
        assert job.done and not engine.accepting
        with pytest.raises(EngineClosed):
            await engine.submit("after drain")


async def test_extreme_sampling_values_fail_nobody(engine: Engine):
    neighbour = await engine.submit("neighbour", max_tokens=8, **GREEDY)
    tiny = await engine.generate(
        "tiny temperature", max_tokens=8, temperature=1e-300, ignore_eos=True
    )
    greedy = await engine.generate("tiny temperature", max_tokens=8, **GREEDY)
    assert tiny.token_ids == greedy.token_ids  # below 1e-5 is greedy, not an overflow
    hot = await engine.generate(
        "hot", max_tokens=8, temperature=100, seed=2**63 - 1, ignore_eos=True
    )
    assert hot.finish_reason == "length"
    assert (await neighbour.wait()).finish_reason == "length"
    with pytest.raises(InvalidRequest, match="seed"):
        await engine.generate("x", seed=2**63)


async def test_merged_streams_interleave_samples_as_they_arrive(engine: Engine):
    from kvscope import merge_streams

    jobs = await engine.submit_samples(
        "merge", n=3, max_tokens=6, temperature=0.9, seed=1, ignore_eos=True
    )
    order: list[int] = []
    texts = ["", "", ""]
    ends: list[int] = []
    async for index, delta in merge_streams(jobs):
        if delta is None:
            ends.append(index)
        else:
            order.append(index)
            texts[index] += delta.text
    assert sorted(ends) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [job.result.text for job in jobs]
    # The samples decode in the same steps, so their deltas alternate rather than
    # arriving one sample after another.
    assert order[:3] != [0, 0, 0] and len(set(order[:6])) > 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
async def test_an_audit_log_that_cannot_be_written_loses_lines_not_requests() -> None:
    # Every write to /dev/full fails with ENOSPC, as on a full disk.
    async with open_engine(audit_log="/dev/full") as engine:
        done = await engine.generate("full disk", max_tokens=3, **GREEDY)
        job = await engine.submit("cancelled", max_tokens=10_000, **GREEDY)
        async for _ in job:  # running, with KV blocks: its first token is out
            break
        report = await engine.cancel(job.id)
    stats = engine.stats()  # closed: every task has ended
    assert done.finish_reason == "length" and report.found and report.blocks_released > 0
    assert stats["kv_blocks_in_use"] == 0 and stats["tasks"] == 0
    assert [r["id"] for r in engine.audit_records()] == [done.id, job.id]  # kept in memory


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"stop": [""]}, "stop"),
        ({"nonsense": 1}, "nonsense"),
        ({"timeout": -1}, "timeout"),
        ({"priority": "high"}, "priority"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logit_bias": {10**6: 1}}, "logit_bias"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
        ({"lora": "missing"}, "lora"),
    ],
)
async def test_an_invalid_request_carries_its_field(engine: Engine, bad: dict, field: str):
    with pytest.raises(InvalidRequest) as caught:
        await engine.generate("x", **bad)
    assert caught.value.field == field, caught.value


async def test_a_prompt_the_model_cannot_take_is_about_the_prompt():
    async with open_engine(max_model_len=64) as engine:
        for prompt in ("", [1, 10**6], list(range(1, 70)), list(range(1, 65))):
            with pytest.raises(InvalidRequest) as caught:
                await engine.generate(prompt, max_tokens=1)
            assert caught.value.field == "prompt", caught.value
        with pytest.raises(InvalidRequest) as caught:
            await engine.generate(list(range(1, 60)), max_tokens=10, min_tokens=10)
        assert caught.value.field == "min_tokens", caught.value
