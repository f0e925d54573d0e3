"""Ended requests stay addressable by id within a history bounded by count and by
bytes; what a kept request holds is its summary, text and token ids, and a reader
(even one that started before the request ended) still gets all of its output."""

from __future__ import annotations

import pytest

from tests.conftest import open_engine

pytestmark = pytest.mark.anyio

RUN = {"max_tokens": 20, "ignore_eos": True, "temperature": 0}


async def test_the_history_is_bounded_by_bytes_and_keeps_what_a_look_up_needs():
    async with open_engine(finished_history_bytes=40_000) as engine:
        slow_reader = await engine.submit("watched", **RUN)
        reader = aiter(engine.watch(slow_reader.id))
        first = await anext(reader)  # reads one delta now, the rest after it was folded
        results = [await engine.generate(f"request {i}", **RUN) for i in range(10)]
        stats = engine.stats()
        assert 0 < stats["history_bytes"] <= 40_000
        assert stats["history"] < 11  # the oldest were forgotten to stay under the bytes
        assert engine.get(slow_reader.id) is None
        kept = [r for r in results if engine.get(r.id) is not None]
        assert kept and kept[-1] is results[-1]
        for result in kept:
            info = engine.get(result.id)
            assert info.status == "finished" and info.token_ids == result.token_ids
            assert info.text == result.text and info.prompt_tokens == result.prompt_tokens
            watched = [delta async for delta in engine.watch(result.id)]
            assert "".join(d.text for d in watched) == result.text
            assert sum((d.token_ids for d in watched), ()) == result.token_ids
        rest = [delta async for delta in reader]
        whole = (await slow_reader.wait()).token_ids
        assert first.token_ids + sum((d.token_ids for d in rest), ()) == whole


async def test_the_history_is_bounded_by_count():
    async with open_engine(finished_history=3) as engine:
        results = [await engine.generate(f"r{i}", max_tokens=2) for i in range(5)]
        assert [engine.get(r.id) is not None for r in results] == [False] * 2 + [True] * 3
        assert engine.stats()["history"] == 3


async def test_a_reader_behind_a_folded_request_still_gets_every_logprob():
    async with open_engine(finished_history_bytes=40_000) as engine:
        job = await engine.submit("watched with logprobs", logprobs=2, **RUN)
        reader = aiter(engine.watch(job.id))
        first = await anext(reader)  # one delta now, the rest once it was folded
        result = await job.wait()
        for i in range(10):  # push it out of the per-token history
            await engine.generate(f"request {i}", **RUN)
        rest = [delta async for delta in reader]
        read = list(first.logprobs) + [lp for delta in rest for lp in delta.logprobs]
        assert result.logprobs is not None and read == list(result.logprobs)
