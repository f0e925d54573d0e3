"""`WakeFloor`, the machine's wake-up latency sampled beside a benchmark's run: a run
shorter than one sleep still gets a sample, a longer one gets about one per interval,
and its child is gone once the block ends, on both anyio backends."""

from __future__ import annotations

import anyio
import pytest

from kvscope.bench.core.wake_floor import WakeFloor

pytestmark = pytest.mark.anyio


async def test_a_run_shorter_than_one_sleep_still_has_a_sample() -> None:
    async with WakeFloor(0.05) as floor:
        pass  # the run ends at once: the child is told before its first wake-up
    assert len(floor.samples) == 1 and floor.samples[0] >= 0


async def test_a_longer_run_samples_each_interval() -> None:
    interval, run = 0.02, 0.3
    async with WakeFloor(interval) as floor:
        await anyio.sleep(run)
    # At most one sleep per interval fits in the run (each wakes on time or late).
    assert 1 <= len(floor.samples) <= run / interval + 1
    assert all(late >= 0 for late in floor.samples)


async def test_a_failed_run_keeps_no_figures() -> None:
    with pytest.raises(ZeroDivisionError):
        async with WakeFloor(0.01) as floor:
            await anyio.sleep(0.05)
            1 / 0  # noqa: B018
    assert floor.samples == []
