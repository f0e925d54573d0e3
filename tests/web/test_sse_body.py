"""StreamBody, the SSE body, without a server: a body dropped before anyone iterated it
(the client left between the route's return and the stream's start) still cancels its
request, and a body that ran to its end cancels nothing. The per-token templates give
the bytes of the event objects they stand for."""

from __future__ import annotations

import gc

import pytest

from kvscope import Delta
from kvscope.kernels.sampling import TokenLogprobs
from kvscope.web.context import ServerContext
from kvscope.web.native.events import TokenEvents, token_event
from kvscope.web.openai.format import ChunkFormat
from kvscope.web.ops.metrics import Metrics
from kvscope.web.settings import ServerSettings
from kvscope.web.sse import StreamBody, dumps, encode
from tests.conftest import open_engine, wait_for


async def _events(job):  # the shape of the routes' generators: consume only
    async for delta in job:
        yield {"id": job.id, "text": delta.text}


@pytest.mark.anyio
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


@pytest.mark.anyio
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


TEXTS = ["", " word", 'a "quoted" \\ back', "tab\tnew\nline\r\x00\x1f", "é漢字🙂", "\ud800"]


@pytest.mark.parametrize("chat", [False, True])
def test_the_per_token_chunk_template_is_the_chunk_object(chat: bool) -> None:
    """The per-token path fills a pre-built template; its bytes are those of the chunk
    object every other chunk is encoded from, whatever the text holds."""
    fmt = ChunkFormat('cmpl-"1"', 1_700_000_000, "tiny/é", chat=chat)
    for index in (0, 7, 123):
        for text in TEXTS:
            assert fmt.text_chunk(index, text) == encode(fmt.chunk(index, text, None))


def test_the_per_token_event_template_is_the_token_event() -> None:
    tokens = TokenEvents('req-"1"')
    for text in TEXTS:
        for ids in [(), (5,), (0, 12, 65535)]:
            delta = Delta(text, ids)
            assert tokens.json(delta) == dumps(token_event('req-"1"', delta))
    logprobs = (TokenLogprobs(-0.5, ((3, -0.5), (4, -1.25))),)
    delta = Delta("x", (3,), logprobs)
    assert tokens.json(delta) == dumps(token_event('req-"1"', delta))
