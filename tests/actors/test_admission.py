"""Admission counts sequences, not requests, and nothing can slip in between the check
and the enqueue: concurrent callers whose prompts are tokenized in worker threads (so
that they interleave) never overfill the queue. Runs on asyncio and trio."""

from __future__ import annotations

import anyio
import pytest

from kvscope import EngineOverloaded, Job
from tests.conftest import open_engine, wait_for

pytestmark = pytest.mark.anyio

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


async def test_the_queue_cap_counts_samples_and_holds_under_concurrency():
    config = {"max_num_seqs": 1, "max_queued_requests": 6, "tokenize_in_thread_bytes": 0}
    async with open_engine(**config) as engine:
        blocker = await engine.submit("blocker", **LONG)
        await wait_for(lambda: blocker.info().status == "running")
        accepted: list[list[Job]] = []
        refused: list[str] = []

        async def client(n: int) -> None:
            try:
                accepted.append(await engine.submit_samples(f"prompt {n}", n=n, **LONG))
            except EngineOverloaded as exc:
                refused.append(str(exc))

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(client, 4)
        assert len(accepted) == 1 and len(refused) == 9
        assert "max_queued_requests" in refused[0]
        assert engine.stats()["waiting"] == 4
        await client(2)  # 4 + 2 fits exactly; then nothing more does
        await client(1)
        assert len(accepted) == 2 and engine.stats()["waiting"] == 6
        for jobs in accepted:
            await engine.cancel(jobs[0].id)
        await engine.cancel(blocker.id)
