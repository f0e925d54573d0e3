"""The largest request tree the limits allow (a parent chain `max_request_depth` deep,
`max_family_size` members in all) cancels cleanly every way: by id, by its root's
timeout, and by closing the engine with it live. Nothing recurses in proportion to its
depth, every block comes back, every task ends, and each member writes one audit line.
The first request past either limit is refused, naming it. Runs on asyncio and trio."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from kvscope import Engine, EngineConfig, EngineOverloaded, InvalidRequest, Job
from tests.conftest import StepGate, assert_clean, open_engine, wait_for

pytestmark = pytest.mark.anyio

DEFAULTS = EngineConfig()
DEPTH, FAMILY = DEFAULTS.max_request_depth, DEFAULTS.max_family_size
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
#: A small batch on a small pool: the tree queues, runs and is preempted while it lives.
ENGINE = {"max_num_seqs": 8, "num_kv_blocks": 96}


async def build_largest_tree(engine: Engine, **root: object) -> list[Job]:
    """A chain DEPTH deep under one root, the rest of the family as children spread
    over the chain, then proof that both limits hold: FAMILY members in all."""
    jobs = [await engine.submit("root", **LONG, **root)]
    for _ in range(DEPTH):
        jobs.append(await engine.submit("c", parent=jobs[-1].id, **LONG))
    chain = list(jobs)
    while len(jobs) < FAMILY:
        parent = chain[len(jobs) % DEPTH]  # any but the deepest, which is at the limit
        jobs.append(await engine.submit("b", parent=parent.id, **LONG))
    with pytest.raises(InvalidRequest, match="max_request_depth"):
        await engine.submit("too deep", parent=chain[-1].id, **LONG)
    with pytest.raises(EngineOverloaded, match="max_family_size"):
        await engine.submit("one too many", parent=chain[0].id, **LONG)
    assert engine.stats()["live_requests"] == FAMILY
    return jobs


async def settled(engine: Engine) -> None:
    """Wait until no request is live and the last step has unpinned their blocks."""
    stats = engine.stats
    await wait_for(lambda: stats()["live_requests"] == 0 and stats()["kv_blocks_in_use"] == 0)


def assert_all_cancelled(engine: Engine, jobs: list[Job], root_reason: str) -> None:
    """Every member cancelled (the root for `root_reason`, the rest for it or as its
    descendants), one audit line each, and nothing left behind."""
    assert_clean(engine)
    audit = Counter(record["id"] for record in engine.audit_records())
    for index, job in enumerate(jobs):
        result = job.result
        assert result.finish_reason == "cancelled", result
        allowed = {root_reason} if index == 0 else {root_reason, "parent"}
        assert result.cancel_reason in allowed, result
        assert audit[job.id] == 1, job.id


async def test_the_largest_tree_cancels_by_id():
    async with open_engine(**ENGINE) as engine:
        jobs = await build_largest_tree(engine)
        report = await engine.cancel(jobs[0].id, reason="user")
        assert report.found and report.cancelled_children == FAMILY - 1
        await settled(engine)
        assert_all_cancelled(engine, jobs, "user")
        # the family limit counts live members: the same tree fits again
        again = await build_largest_tree(engine)
        await engine.cancel(again[0].id)


async def test_a_deep_chain_of_ended_requests_is_walked_without_recursion():
    """Cancelling an ended request reaches its live descendants through ended ones."""
    async with open_engine(**ENGINE) as engine:
        short = {"max_tokens": 1, "ignore_eos": True, "temperature": 0}
        chain = [await engine.submit("root", **short)]
        for _ in range(DEPTH - 1):
            chain.append(await engine.submit("c", parent=chain[-1].id, **short))
        leaf = await engine.submit("leaf", parent=chain[-1].id, **LONG)
        await wait_for(lambda: all(job.done for job in chain), timeout=30)
        report = await engine.cancel(chain[0].id)
        assert report.status == "finished" and report.cancelled_children >= 1
        assert (await leaf.wait()).cancel_reason == "parent"
        await settled(engine)
        assert_clean(engine)


async def test_the_largest_tree_cancels_by_its_roots_timeout():
    async with open_engine(**ENGINE) as engine:
        # The first step is held until the timeout has fired: on a fast machine the root
        # could otherwise reach its max_tokens first (seen in CI: finish_reason length).
        gate = StepGate(engine)
        jobs = await build_largest_tree(engine, timeout=5.0)
        await wait_for(lambda: jobs[0].done, timeout=60)
        gate.open()
        await settled(engine)
        assert_all_cancelled(engine, jobs, "timeout")


async def test_closing_the_engine_with_the_largest_tree_live():
    async with open_engine(**ENGINE) as engine:
        jobs = await build_largest_tree(engine)
    assert_all_cancelled(engine, jobs, "shutdown")


async def test_samples_count_against_the_family_limit():
    async with open_engine(max_family_size=4) as engine:
        with pytest.raises(InvalidRequest, match="max_family_size"):
            await engine.submit_samples("x", n=5, **LONG)
        jobs = await engine.submit_samples("x", n=4, **LONG)
        with pytest.raises(EngineOverloaded, match="max_family_size"):
            await engine.submit("x", parent=jobs[0].id, **LONG)
        await engine.cancel(jobs[0].id)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_kvscope_walks_a_tree_deeper_than_the_recursion_limit(anyio_backend: str):
    """kvscope's own walks of the tree are iterative: on trio (whose cancel delivery
    does not recurse either), a chain deeper than Python's recursion limit cancels."""
    depth = sys.getrecursionlimit() + 100
    config = {"max_request_depth": depth, "max_family_size": depth + 1, "max_num_seqs": 1}
    async with open_engine(**config) as engine:
        gate = StepGate(engine)
        root = await engine.submit("root", **LONG)
        await gate.wait_entered()  # no step runs while the chain is built
        parent = root
        for _ in range(depth):
            parent = await engine.submit("c", parent=parent.id, **LONG)
        assert engine.cancel_nowait(root.id)
        gate.open()
        assert (await parent.wait()).cancel_reason == "parent"
        await settled(engine)
