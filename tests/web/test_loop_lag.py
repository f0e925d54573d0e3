"""The event-loop lag probe measures how late the loop serves a ready descriptor: a
loop blocked by a synchronous call shows up as lag at least that long. Runs on asyncio
and trio."""

from __future__ import annotations

import sys
import time

import anyio
import pytest

from kvscope.web.ops.loop_lag import LagProbe
from tests.conftest import wait_for

pytestmark = pytest.mark.anyio


async def test_a_blocked_loop_is_measured_as_lag():
    samples: list[float] = []
    probe = LagProbe(samples.append)
    if sys.platform == "linux":
        assert probe.method == "timerfd"
    async with anyio.create_task_group() as tg:
        tg.start_soon(probe.run, 0.005)
        await wait_for(lambda: len(samples) >= 2)
        before = len(samples)
        time.sleep(0.05)  # the loop is blocked: the probe's timer fires meanwhile
        await wait_for(lambda: len(samples) > before)
        tg.cancel_scope.cancel()
    assert samples[before] >= 0.03
