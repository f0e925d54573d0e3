"""Prefix sharing: children and repeated prompts reuse KV blocks instead of copying them,
and releasing one sharer never frees a block another still holds."""

from __future__ import annotations

import pytest

from tests.conftest import open_engine, wait_for

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = list(range(1, 81))  # 5 full blocks of 16


async def test_children_share_the_parents_prompt_blocks():
    async with open_engine() as engine:
        parent = await engine.submit(PROMPT, max_tokens=2000, **GREEDY)
        await wait_for(lambda: parent.info().tokens_generated >= 1)
        before = engine.stats()["kv_blocks_in_use"]
        children = [
            await engine.submit(PROMPT, parent=parent.id, max_tokens=2000, **GREEDY)
            for _ in range(3)
        ]
        await wait_for(lambda: all(c.info().tokens_generated >= 1 for c in children))
        grown = engine.stats()["kv_blocks_in_use"] - before
        # A full copy would be 6 blocks each; a child shares 4 and copies on write the
        # block of the prompt token it recomputes (for its first logits), plus 1 new.
        # (The parent's own decoding may take one more block meanwhile.)
        assert grown <= 3 * 2 + 1, grown
        await engine.cancel(parent.id)


async def test_a_repeated_prompt_hits_the_prefix_cache():
    async with open_engine() as engine:
        first = await engine.generate(PROMPT, max_tokens=4, **GREEDY)
        cached = engine.stats()["kv_blocks_cached"]
        assert cached >= 5
        again = await engine.submit(PROMPT, max_tokens=400, **GREEDY)
        await wait_for(lambda: again.info().tokens_generated >= 1)
        # Reused, not recomputed: its first 4 blocks left the cache for its table (the
        # 5th holds the prompt token it recomputes for its first logits).
        assert engine.stats()["kv_blocks_cached"] <= cached - 4
        await engine.cancel(again.id)
        rerun = await engine.generate(PROMPT, max_tokens=4, **GREEDY)
        assert rerun.token_ids == first.token_ids
        # The completion says how much of its prompt it found computed: the 4 full
        # blocks before the one holding the token it recomputes.
        assert first.cached_tokens == 0 and rerun.cached_tokens == 4 * 16
        assert (await again.wait()).cached_tokens == 4 * 16


async def test_releasing_one_sharer_never_frees_a_block_another_holds():
    async with open_engine() as engine:
        alone = await engine.generate(PROMPT, max_tokens=30, **GREEDY)
        parent = await engine.submit(PROMPT, max_tokens=30, **GREEDY)
        child = await engine.submit(PROMPT, parent=parent.id, max_tokens=2000, **GREEDY)
        await wait_for(lambda: child.info().tokens_generated >= 1)
        await engine.cancel(child.id)
        assert engine.stats()["kv_blocks_in_use"] >= 6  # the parent's, shared ones kept
        engine.check_integrity()
        assert (await parent.wait()).token_ids == alone.token_ids


async def test_parent_and_children_generate_the_same_greedy_tokens():
    async with open_engine() as engine:
        alone = await engine.generate(PROMPT, max_tokens=24, **GREEDY)
        parent = await engine.submit(PROMPT, max_tokens=24, **GREEDY)
        children = [
            await engine.submit(PROMPT, parent=parent.id, max_tokens=24, **GREEDY) for _ in range(2)
        ]
        results = [await job.wait() for job in (parent, *children)]
        assert all(r.token_ids == alone.token_ids for r in results)


async def test_samples_start_as_one_family_that_shares_and_cancels_together():
    async with open_engine() as engine:
        jobs = await engine.submit_samples(
            PROMPT, n=4, max_tokens=1, temperature=0.7, seed=5, ignore_eos=True
        )
        assert len(jobs) == 4 and len({j.id for j in jobs}) == 4
        parent = engine.get(jobs[0].id)
        assert parent.children == tuple(j.id for j in jobs[1:])
        results = [await j.wait() for j in jobs]  # max_tokens=1: none of them is refused
        assert all(r.finish_reason == "length" for r in results)
        # Sample i draws with seed 5 + i, as a lone request with that seed does.
        for index, result in enumerate(results):
            alone = await engine.generate(PROMPT, max_tokens=1, temperature=0.7, seed=5 + index)
            assert alone.token_ids == result.token_ids, index

        family = await engine.submit_samples(PROMPT, n=3, max_tokens=2000, **GREEDY)
        await wait_for(lambda: all(j.info().tokens_generated >= 1 for j in family))
        # One prompt's blocks (5, or 6 with the first token) and two per sample beside
        # it (a copy of the partial block and one new), not three copies (18).
        assert engine.stats()["kv_blocks_in_use"] <= 6 + 2 * 2 + 1
        report = await engine.cancel(family[0].id)
        assert report.cancelled_children == 2
        assert [(await j.wait()).finish_reason for j in family] == ["cancelled"] * 3


async def test_the_prefix_cache_is_shared_only_within_one_owner():
    """No owner can time another's prompts: a prompt that owner `a` ran hits the cache
    for `a` again, never for `b` (unless isolation is turned off)."""
    for isolate in (True, False):
        async with open_engine(isolate_prefix_cache=isolate) as engine:
            await engine.generate(PROMPT, max_tokens=4, owner="key-a", **GREEDY)
            cached = engine.stats()["kv_blocks_cached"]
            assert cached >= 5
            for owner, shared in (("key-b", not isolate), ("key-a", True)):
                job = await engine.submit(PROMPT, max_tokens=400, owner=owner, **GREEDY)
                await wait_for(lambda job=job: job.info().tokens_generated >= 1)
                # a hit takes the cached blocks out of the cache; a miss leaves them
                assert (engine.stats()["kv_blocks_cached"] < cached) == shared, (owner, isolate)
                await engine.cancel(job.id)
                cached = engine.stats()["kv_blocks_cached"]
