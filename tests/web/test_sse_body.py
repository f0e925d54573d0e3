"""StreamBody, the SSE body, without a server: a body dropped before anyone iterated it
(the client left between the route's return and the stream's start) still cancels its
request, and a body that ran to its end cancels nothing."""

from __future__ import annotations

import gc

import pytest

from kvscope.web.context import ServerContext
from kvscope.web.metrics import Metrics
from kvscope.web.settings import ServerSettings
from kvscope.web.sse import StreamBody
from tests.conftest import open_engine, wait_for

pytestmark = pytest.mark.anyio


async def _events(job):  # the shape of the routes' generators: consume only
    async for delta in job:
        yield {"id": job.id, "text": delta.text}


async def test_a_body_dropped_unread_cancels_its_request():
    async with open_engine() as engine:
        ctx = ServerContext(engine, ServerSettings(), Metrics())
        job = await engine.submit("never read", max_tokens=3000, ignore_eos=True)
        body = StreamBody(ctx, _events(job), cancel_ids=[job.id])
        del body
        gc.collect()
        await wait_for(lambda: job.done)
        assert job.result.finish_reason == "cancelled"
        assert job.result.cancel_reason == "disconnect"
        assert ctx.open_streams == 0


async def test_a_body_read_to_its_end_cancels_nothing():
    async with open_engine() as engine:
        ctx = ServerContext(engine, ServerSettings(), Metrics())
        job = await engine.submit("read me", max_tokens=4, ignore_eos=True)
        body = StreamBody(ctx, _events(job), cancel_ids=[job.id])
        chunks = [chunk async for chunk in body]
        assert len(chunks) >= 4 and all(c.startswith(b"data: ") for c in chunks)
        del body
        gc.collect()
        assert job.result.finish_reason == "length"
        assert ctx.open_streams == 0
