"""Admissions go one to a pass of the event loop (`ServerContext.admission_turn`): a
burst of requests never has all its bodies parsed and jobs submitted in one pass, in
which nothing else (a DELETE, a stream's token) would be served. Runs on asyncio and
trio."""

from __future__ import annotations

import anyio
import pytest

from kvscope.web.context import ServerContext
from kvscope.web.ops.metrics import Metrics
from kvscope.web.settings import ServerSettings
from tests.conftest import open_engine

pytestmark = pytest.mark.anyio


async def test_a_burst_of_admissions_goes_one_to_a_pass():
    async with open_engine() as engine:
        ctx = ServerContext(engine, ServerSettings(), Metrics())
        passes = 0
        admitted_in: list[int] = []

        async def count_passes() -> None:
            nonlocal passes
            while True:
                passes += 1
                await anyio.lowlevel.checkpoint()

        async def admission() -> None:
            await ctx.admission_turn()
            admitted_in.append(passes)  # what follows the turn runs in its pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(count_passes)
            await anyio.lowlevel.checkpoint()
            async with anyio.create_task_group() as burst:
                for _ in range(6):  # all ready in the same pass, as a burst of POSTs
                    burst.start_soon(admission)
            tg.cancel_scope.cancel()
    assert len(admitted_in) == 6
    # Each in a pass of its own. The counter moves once a pass and, within a pass, trio
    # runs the tasks in either order, so one pass apart two may read the same count,
    # two passes apart never. With a plain checkpoint instead of the line, all six ran
    # in the same pass and read the same count.
    assert all(c > a for a, c in zip(admitted_in, admitted_in[2:], strict=False)), admitted_in
