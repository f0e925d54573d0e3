"""Stress: a few hundred requests with random priorities, children and cancels at random
moments (by id, by the caller's scope, by timeout, by a parent's cancel) on a pool small
enough to force preemption. Afterwards nothing is in use, nothing is live, and every
request is accounted for exactly once. Prints the cancel-to-release p50/p99."""

from __future__ import annotations

import random
import statistics

import anyio
import pytest

from kvscope import Engine, RequestConflict, UnknownRequest
from tests.conftest import REPORT_LINES, open_engine

pytestmark = pytest.mark.anyio

NUM_REQUESTS = 300


async def drive(
    engine: Engine, rng: random.Random, ids: list[str], release_seconds: list[float]
) -> None:
    async def one(index: int) -> None:
        prompt = [rng.randrange(256) for _ in range(rng.randint(4, 120))]
        params = {
            "max_tokens": rng.randint(1, 80),
            "temperature": rng.choice([0, 0.8]),
            "ignore_eos": True,
        }
        priority = rng.randint(0, 3)
        fate = rng.random()
        parent = rng.choice(ids) if ids and fate < 0.15 else None
        try:
            if fate < 0.25:  # the caller's scope ends at a random moment
                with anyio.move_on_after(rng.random() * 0.05):
                    async with engine.request(
                        prompt, priority=priority, parent=parent, **params
                    ) as req:
                        ids.append(req.id)
                        async for _ in req:
                            pass
                return
            timeout = rng.random() * 0.05 if fate < 0.35 else None
            job = await engine.submit(
                prompt, priority=priority, parent=parent, timeout=timeout, **params
            )
            ids.append(job.id)
            if fate < 0.7:  # cancelled by id at a random moment
                await anyio.sleep(rng.random() * 0.03)
                report = await engine.cancel(job.id, reason="user")
                if report.release_seconds is not None:
                    release_seconds.append(report.release_seconds)
            await job.wait()
        except (UnknownRequest, RequestConflict):
            pass  # the chosen parent ended before the child could join it

    async with anyio.create_task_group() as tg:
        for index in range(NUM_REQUESTS):
            tg.start_soon(one, index)
            if index % 10 == 0:
                await anyio.sleep(rng.random() * 0.01)


async def test_stress_random_cancels_preemption_and_children(anyio_backend: str):
    rng = random.Random(1234)
    ids: list[str] = []
    release_seconds: list[float] = []
    async with open_engine(num_kv_blocks=48, max_num_seqs=16, max_num_batched_tokens=128) as engine:
        baseline = _task_count(anyio_backend)
        await drive(engine, rng, ids, release_seconds)
        with anyio.fail_after(60):
            await engine.wait_idle()
        stats = engine.stats()
        assert stats["kv_blocks_in_use"] == 0 and stats["live_requests"] == 0
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["tasks"] == 0
        assert _task_count(anyio_backend) == baseline
        preemptions = engine.step_statistics().preemptions
        engine.check_integrity()

    records = engine.audit_records()
    assert sorted(r["id"] for r in records) == sorted(ids)  # each exactly once
    assert stats["finished"] + stats["cancelled"] + stats["failed"] == len(ids)
    assert stats["failed"] == 0
    reasons = {r["cancel_reason"] for r in records if r["finish_reason"] == "cancelled"}
    assert {"user", "scope", "timeout"} <= reasons
    assert preemptions > 0, "the pool was meant to be small enough to preempt"
    assert len(release_seconds) > 20
    cuts = statistics.quantiles(release_seconds, n=100)
    REPORT_LINES.append(
        f"stress [{anyio_backend}]: {len(ids)} requests, {stats['cancelled']} cancelled, "
        f"{preemptions} preemptions; cancel-to-release over {len(release_seconds)} cancels by id: "
        f"p50 {cuts[49] * 1000:.2f} ms, p99 {cuts[98] * 1000:.2f} ms"
    )


def _task_count(backend: str) -> int:
    if backend == "asyncio":
        import asyncio

        return len(asyncio.all_tasks())
    import trio

    def count(task: trio.lowlevel.Task) -> int:
        return 1 + sum(count(t) for n in task.child_nurseries for t in n.child_tasks)

    return count(trio.lowlevel.current_root_task())
