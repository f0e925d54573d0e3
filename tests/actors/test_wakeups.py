"""ReaderWakeups: a step's readers wake a group at a time, every one of them, and none
is left waiting at shutdown. Runs on asyncio and trio."""

from __future__ import annotations

import anyio
import pytest

from kvscope.actors.wakeups import GROUP, ReaderWakeups
from tests.conftest import wait_for

pytestmark = pytest.mark.anyio


def count_set(events: list[anyio.Event]) -> int:
    return sum(event.is_set() for event in events)


async def test_readers_wake_a_group_a_pass():
    wakeups = ReaderWakeups()
    events = [anyio.Event() for _ in range(3 * GROUP + 1)]
    passes: list[int] = []  # how many were set each time this task got to run
    async with anyio.create_task_group() as tg:
        await tg.start(wakeups.run)
        wakeups.wake(events)
        assert count_set(events) == 0  # none before the loop's next pass
        while count_set(events) < len(events):
            await anyio.lowlevel.checkpoint()
            passes.append(count_set(events))
        tg.cancel_scope.cancel()
    # this task ran between the groups (trio orders a pass's tasks at random, so it may
    # see two groups between two of its own turns, never all of them)
    steps = [b - a for a, b in zip([0, *passes], passes, strict=False)]
    assert max(steps) <= 2 * GROUP and len(passes) >= 3


async def test_shutdown_wakes_every_reader_still_queued_and_later_ones_at_once():
    wakeups = ReaderWakeups()
    events = [anyio.Event() for _ in range(5 * GROUP)]
    async with anyio.create_task_group() as tg:
        await tg.start(wakeups.run)
        wakeups.wake(events)
        tg.cancel_scope.cancel()  # before the task could set them all
    assert count_set(events) == len(events)
    late = [anyio.Event() for _ in range(3)]
    wakeups.wake(late)  # the task is gone (a step delivering during shutdown)
    assert count_set(late) == len(late)


async def test_readers_queued_behind_others_all_wake():
    wakeups = ReaderWakeups()
    first = [anyio.Event() for _ in range(2 * GROUP)]
    second = [anyio.Event() for _ in range(3)]
    async with anyio.create_task_group() as tg:
        await tg.start(wakeups.run)
        wakeups.wake(first)
        wakeups.wake(second)  # earlier ones still queued: these wait their turn
        assert count_set(second) == 0
        await wait_for(lambda: count_set(first + second) == len(first + second))
        tg.cancel_scope.cancel()
