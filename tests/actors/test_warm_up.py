"""The thread worker's warm-up (`execution/warm_up.py`): the step actor builds the row
buckets while it has no work, gives way to the requests that arrive, and is stopped by
the engine's close; on both anyio backends."""

from __future__ import annotations

import logging

import anyio
import pytest

from kvscope import Engine
from kvscope.config import EngineConfig
from kvscope.kernels.linear import row_buckets
from tests.conftest import open_engine, wait_for

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
PROMPTS = ["warm the buckets", "a second prompt, longer than the first one", "third"]


def bucketed(engine: Engine) -> None:
    if not engine.stats()["warm_up_pending"]:
        pytest.skip("this CPU has no prepacked oneDNN layout: nothing runs at row buckets")


async def answers(engine: Engine) -> list[tuple[int, ...]]:
    results: list[tuple[int, ...]] = [()] * len(PROMPTS)

    async def one(index: int) -> None:
        results[index] = (await engine.generate(PROMPTS[index], **GREEDY)).token_ids

    async with anyio.create_task_group() as tg:
        for index in range(len(PROMPTS)):
            tg.start_soon(one, index)
    return results


async def test_an_idle_engine_builds_every_bucket_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="kvscope.execution.warm_up"):
        async with open_engine(dtype="bfloat16") as engine:
            bucketed(engine)
            await wait_for(lambda: engine.stats()["warm_up_pending"] == 0, 60, "the warm-up")
    buckets = row_buckets(EngineConfig().max_num_batched_tokens)
    assert f"warmed up {len(buckets)} row counts (up to {buckets[-1]} rows)" in caplog.text


async def test_requests_sent_during_the_warm_up_get_the_tokens_they_get_after_it():
    """The requests arrive while buckets are pending (the warm-up gives way at its next
    checkpoint and takes up the bucket it left once they are done); their tokens are
    the ones an engine that has finished its warm-up gives."""
    async with open_engine(dtype="bfloat16") as engine:
        bucketed(engine)
        during = await answers(engine)
        # the warm-up runs only while there is no work: most of it is still to come
        assert engine.stats()["warm_up_pending"] > 0
        await wait_for(lambda: engine.stats()["warm_up_pending"] == 0, 60, "the warm-up")
        after = await answers(engine)
    assert during == after
    assert all(len(tokens) == GREEDY["max_tokens"] for tokens in during)


async def test_an_engine_closed_during_its_warm_up_closes_clean():
    """Closing stops the running warm-up step at its next checkpoint; `open_engine`
    checks that nothing is left behind, and the next engine warms up again."""
    with anyio.fail_after(60):  # a hang guard, not a timing
        async with open_engine(dtype="bfloat16") as engine:
            bucketed(engine)
        async with open_engine(dtype="bfloat16") as engine:
            assert len((await engine.generate(PROMPTS[0], **GREEDY)).token_ids) == 12
