"""Shared test fixtures: both anyio backends, and engines on the tiny random model.

Every engine a test opens is checked on close: no KV block in use, the pool's
invariants hold, no request task left.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from kvscope import Engine


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@asynccontextmanager
async def open_engine(model: str = "tiny-random", **config: Any) -> AsyncIterator[Engine]:
    """An engine on `model` that asserts, once closed, that nothing leaked."""
    config.setdefault("debug", True)
    config.setdefault("num_kv_blocks", 256)
    async with Engine.open(model, device="cpu", **config) as engine:
        yield engine
    assert_clean(engine)


def assert_clean(engine: Engine) -> None:
    engine.pool.check_integrity()
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == 0, stats
    assert stats["live_requests"] == 0, stats
    assert stats["running"] == 0 and stats["waiting"] == 0, stats


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    async with open_engine() as opened:
        yield opened
