"""Every way a request can be cancelled ends the same way: finish reason `cancelled`
with the right cancel reason, its KV blocks released, exactly one audit line, and the
other requests undisturbed. Runs on asyncio and trio."""

from __future__ import annotations

import time

import anyio
import pytest

from kvscope import Engine
from tests.conftest import StepGate, assert_clean, audit_lines, open_engine, wait_for

pytestmark = pytest.mark.anyio

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def assert_cancelled(engine: Engine, request_id: str, reason: str) -> None:
    info = engine.get(request_id)
    assert info is not None
    assert info.status == "cancelled"
    assert info.finish_reason == "cancelled"
    assert info.cancel_reason == reason
    lines = audit_lines(engine, request_id)
    assert len(lines) == 1, lines
    assert lines[0]["finish_reason"] == "cancelled" and lines[0]["cancel_reason"] == reason
    assert lines[0]["released"] is not None
    assert request_id not in engine.step_statistics().in_flight


async def test_cancel_by_id_while_queued():
    async with open_engine(max_num_seqs=1) as engine:
        blocker = await engine.submit("blocker", **LONG)
        await wait_for(lambda: blocker.info().status == "running")
        queued = await engine.submit("queued", **LONG)
        assert queued.info().status == "queued"
        report = await engine.cancel(queued.id, reason="user", by="tester")
        assert report.found and report.status == "queued"
        assert report.blocks_released == 0 and report.tokens_generated == 0
        assert report.release_seconds is not None and not report.in_running_step
        # The report is made after the release, once the end was published.
        assert report.reply_seconds is not None and report.reply_seconds >= report.release_seconds
        assert_cancelled(engine, queued.id, "user")
        assert engine.get(queued.id).cancelled_by == "tester"
        assert (await queued.wait()).finish_reason == "cancelled"
        await engine.cancel(blocker.id)


async def test_cancel_by_id_during_a_prefill_chunk():
    async with open_engine(max_num_batched_tokens=8) as engine:
        job = await engine.submit(list(range(200)), **LONG)
        await wait_for(lambda: engine.step_statistics().steps >= 2)
        gate = StepGate(engine)  # the next prefill chunk is held in flight
        await gate.wait_entered()
        assert job.id in engine.step_statistics().in_flight
        # The cancel answers while the forward is still held: it never waits for it.
        report = await engine.cancel(job.id)
        assert report.status == "running" and report.tokens_generated == 0
        assert report.blocks_released >= 1 and report.in_running_step
        assert engine.stats()["kv_blocks_in_use"] == 0
        assert engine.step_statistics().abort_requested  # nobody else is in the step
        gate.open()
        await wait_for(lambda: engine.step_statistics().aborted_steps == 1)
        assert_cancelled(engine, job.id, "user")


async def test_cancel_by_id_during_decode():
    async with open_engine() as engine:
        job = await engine.submit("decode me", **LONG)
        received = 0
        async for _delta in job:
            received += 1
            if received == 3:
                break
        report = await engine.cancel(job.id, reason="user")
        assert report.status == "running" and report.tokens_generated >= 3
        assert report.blocks_released == engine.get(job.id).prompt_tokens // 16 + 1
        assert_cancelled(engine, job.id, "user")
        result = await job.wait()
        assert result.finish_reason == "cancelled" and len(result.token_ids) >= 3


async def test_cancel_during_a_running_step_frees_blocks_at_once_and_aborts_the_step():
    async with open_engine() as engine:
        job = await engine.submit("in flight", **LONG)
        await wait_for(lambda: job.info().tokens_generated >= 1)
        gate = StepGate(engine)
        await gate.wait_entered()
        assert engine.step_statistics().in_flight == (job.id,)
        assert engine.stats()["kv_blocks_in_use"] > 0
        report = await engine.cancel(job.id)
        # Released and audited while the forward is still held, and the step is told
        # to abort because nobody is left in it.
        assert report.in_running_step and report.blocks_released > 0
        assert engine.stats()["kv_blocks_in_use"] == 0
        assert len(audit_lines(engine, job.id)) == 1
        assert engine.step_statistics().abort_requested
        # The freed blocks are not handed out while the forward may still write them:
        # a request submitted now waits for the held step to end.
        later = await engine.submit("submitted while the step is held", max_tokens=4)
        assert later.info().status == "queued"
        gate.open()
        assert (await later.wait()).finish_reason in ("length", "stop")
        assert engine.step_statistics().aborted_steps == 1
        assert engine.stats()["kv_blocks_in_use"] == 0
        assert_cancelled(engine, job.id, "user")


async def test_caller_scope_cancelled_cancels_the_request():
    async with open_engine() as engine:
        with anyio.CancelScope() as scope:
            async with engine.request("scope", **LONG) as request:
                async for _ in request:
                    scope.cancel()
        assert scope.cancelled_caught
        assert_cancelled(engine, request.id, "scope")
        # Leaving the block waited for the release, in the step or not.
        assert engine.stats()["kv_blocks_in_use"] == 0


async def test_move_on_after_around_generate_cancels_and_frees():
    async with open_engine() as engine:
        with anyio.move_on_after(0.05):
            await engine.generate("timeout by the caller", **LONG)
        (record,) = [r for r in engine.audit_records() if r["cancel_reason"] == "scope"] or [None]
        assert record is not None
        await wait_for(lambda: engine.stats()["kv_blocks_in_use"] == 0)
        assert_cancelled(engine, record["id"], "scope")


async def test_exception_inside_the_request_block_cancels_it():
    async with open_engine() as engine:
        with pytest.raises(ZeroDivisionError):
            async with engine.request("boom", **LONG) as request:
                async for _ in request:
                    1 / 0  # noqa: B018
        assert_cancelled(engine, request.id, "scope")


async def test_breaking_out_of_iteration_cancels_on_leaving_the_block():
    async with open_engine() as engine:
        async with engine.request("break", **LONG) as request:
            async for _ in request:
                break
        assert request.result.finish_reason == "cancelled"
        assert_cancelled(engine, request.id, "scope")


async def test_request_timeout_cancels_with_reason_timeout():
    async with open_engine() as engine:
        job = await engine.submit("slow", timeout=0.05, **LONG)
        result = await job.wait()
        assert result.finish_reason == "cancelled" and result.cancel_reason == "timeout"
        assert_cancelled(engine, job.id, "timeout")


async def test_parent_cancel_cascades_to_children_and_grandchildren():
    async with open_engine() as engine:
        parent = await engine.submit("family", **LONG)
        child = await engine.submit("family", parent=parent.id, **LONG)
        grandchild = await engine.submit("family tree", parent=child.id, **LONG)
        await wait_for(lambda: grandchild.info().tokens_generated > 0)
        report = await engine.cancel(parent.id, reason="user")
        assert report.cancelled_children == 2
        await grandchild.wait()
        await wait_for(lambda: engine.stats()["live_requests"] == 0)
        assert_cancelled(engine, parent.id, "user")
        assert_cancelled(engine, child.id, "parent")
        assert_cancelled(engine, grandchild.id, "parent")
        assert engine.get(grandchild.id).cancelled_by == child.id
        assert engine.get(parent.id).children == (child.id,)


async def test_cancelling_a_child_leaves_its_parent_running():
    async with open_engine() as engine:
        parent = await engine.submit("parent", **LONG)
        child = await engine.submit("parent", parent=parent.id, **LONG)
        await wait_for(lambda: child.info().tokens_generated > 0)
        await engine.cancel(child.id)
        assert parent.info().status == "running"
        before = parent.info().tokens_generated
        await wait_for(lambda: parent.info().tokens_generated > before + 2)
        await engine.cancel(parent.id)


async def test_engine_close_cancels_everything_with_reason_shutdown():
    async with open_engine() as engine:
        jobs = [await engine.submit(f"shutdown {i}", **LONG) for i in range(5)]
        child = await engine.submit("child", parent=jobs[0].id, **LONG)
        await wait_for(lambda: all(j.info().tokens_generated > 0 for j in jobs))
    assert_clean(engine)
    for job in jobs:
        assert_cancelled(engine, job.id, "shutdown")
    assert engine.get(child.id).status == "cancelled"
    assert len(audit_lines(engine, child.id)) == 1


async def test_cancelling_a_finished_request_reports_it_and_changes_nothing():
    async with open_engine() as engine:
        done = await engine.generate("short", max_tokens=3, ignore_eos=True)
        before = engine.stats()
        report = await engine.cancel(done.id)
        assert report.found and report.status == "finished" and report.release_seconds is None
        assert engine.stats() == before
        assert engine.get(done.id).finish_reason == "length"
        assert len(audit_lines(engine, done.id)) == 1


async def test_cancelling_twice_is_safe():
    async with open_engine() as engine:
        job = await engine.submit("twice", **LONG)
        first = await engine.cancel(job.id)
        second = await engine.cancel(job.id)
        assert first.status in ("queued", "running")
        assert second.status == "cancelled" and second.blocks_released == 0
        assert not engine.cancel_nowait(job.id)
        assert len(audit_lines(engine, job.id)) == 1


async def test_cancel_of_an_unknown_id_is_not_found():
    async with open_engine() as engine:
        report = await engine.cancel("req-nope")
        assert not report.found and report.status == "unknown"


async def test_other_requests_are_untouched_by_cancels_around_them():
    async with open_engine(max_num_batched_tokens=64) as engine:
        prompts = [f"survivor number {i}" for i in range(3)]
        alone = [
            await engine.generate(p, max_tokens=40, temperature=0, ignore_eos=True) for p in prompts
        ]
        survivors = [
            await engine.submit(p, max_tokens=40, temperature=0, ignore_eos=True) for p in prompts
        ]
        victims = [await engine.submit(f"victim {i} " * 20, **LONG) for i in range(6)]
        for i, victim in enumerate(victims):
            await wait_for(lambda v=victim, i=i: v.info().tokens_generated > i)
            await engine.cancel(victim.id)
        results = [await s.wait() for s in survivors]
        assert [r.token_ids for r in results] == [a.token_ids for a in alone]


async def test_a_request_cancelled_mid_step_is_released_before_the_step_ends_and_others_keep_their_tokens():
    async with open_engine() as engine:
        prompt = "survivor of a shared step"
        alone = await engine.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
        survivor = await engine.submit(prompt, max_tokens=12, temperature=0, ignore_eos=True)
        victim = await engine.submit("victim of a shared step", **LONG)
        await wait_for(lambda: victim.info().tokens_generated >= 1)
        steps: list[tuple[float, float]] = []
        engine.step_listeners.append(lambda started, seconds, _: steps.append((started, seconds)))
        gate = StepGate(engine)
        await gate.wait_entered()
        steps.clear()  # from here on, the first step reported is the gated one
        assert {victim.id, survivor.id} <= set(engine.step_statistics().in_flight)
        called = time.perf_counter()
        report = await engine.cancel(victim.id)
        # the survivor still wants this step
        assert not engine.step_statistics().abort_requested
        gate.open()
        assert report.in_running_step and report.blocks_released > 0
        await wait_for(lambda: len(steps) >= 1)
        started, seconds = steps[0]
        assert report.release_seconds is not None
        assert called + report.release_seconds < started + seconds  # before the step ended
        assert engine.step_statistics().aborted_steps == 0
        assert (await survivor.wait()).token_ids == alone.token_ids
        assert_cancelled(engine, victim.id, "user")


async def test_a_cancel_after_a_natural_finish_and_before_its_cleanup_changes_nothing():
    """The step delivers a request's last token, and a cancel arrives before the
    request's task has run its cleanup: the request stays finished."""
    async with open_engine() as engine:
        ids: list[str] = []
        attempts: list[bool] = []

        def cancel_once_finished(*_step: object) -> None:  # right after the step delivered
            for request_id in ids:
                info = engine.get(request_id)
                if info is not None and info.status == "finished" and not attempts:
                    attempts.append(engine.cancel_nowait(request_id, reason="user", by="late"))

        engine.step_listeners.append(cancel_once_finished)
        job = await engine.submit("finish first", max_tokens=3, ignore_eos=True)
        ids.append(job.id)
        result = await job.wait()
        assert attempts == [False]
        assert result.finish_reason == "length" and result.cancel_reason is None
        info = engine.get(job.id)
        assert info.status == "finished" and info.finish_reason == "length"
        assert info.cancel_reason is None and info.cancelled_by is None
        (line,) = audit_lines(engine, job.id)
        assert line["finish_reason"] == "length" and line["cancel_reason"] is None
        assert engine.stats()["finished"] == 1 and engine.stats()["cancelled"] == 0
