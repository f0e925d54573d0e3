"""Server-sent events: the body of every streaming response.

`StreamBody` wraps an async generator of events and is handed to Quart as a response
body. An event is a dict (sent as one `data:` line of JSON), a string sent as it is
(JSON text already encoded, or a literal such as `[DONE]`), or bytes already framed
by `frame`/`encode`: a generator that has several messages ready at once yields them
joined, so they go out in one write, and the per-token path hands over pre-encoded
text or bytes (no dict, no `json.dumps` per token).

Quart iterates the body after the route returned, in the connection's task, so
(STYLE 11) it holds no task group or cancel scope across a `yield`; it only consumes.
When it is closed before its events ran out (the client went away, so Quart cancelled
the connection's task and closed the body) it cancels its requests with the
synchronous `engine.cancel_nowait(..., reason="disconnect")`, and so does a body that
is dropped without ever being iterated (the client left before the stream began). It
also counts itself in the server's open streams, so shutdown can wait for every final
event to be sent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from quart import Response

from .context import ServerContext, disconnect_reason

log = logging.getLogger("kvscope.web")

Event = dict[str, Any]
#: The end of an OpenAI stream.
DONE = b"data: [DONE]\n\n"


def dumps(value: Any) -> str:
    """Compact JSON, as every stream sends it."""
    return json.dumps(value, separators=(",", ":"))


def frame(data: str) -> bytes:
    """One SSE message carrying `data` (one line): `data: <data>` and a blank line."""
    return f"data: {data}\n\n".encode()


def encode(event: Event | str | bytes) -> bytes:
    """One SSE message: `data: <json>` (a string as it is) and a blank line; bytes are
    already messages and pass through."""
    if isinstance(event, bytes):
        return event
    return frame(event if isinstance(event, str) else dumps(event))


class StreamBody:
    """An SSE response body over `events`; closing it early cancels `cancel_ids`."""

    def __init__(
        self,
        ctx: ServerContext,
        events: AsyncGenerator[Event | str | bytes, None],
        *,
        cancel_ids: Callable[[], Sequence[str]] | Sequence[str] = (),
    ) -> None:
        self._ctx = ctx
        self._events = events
        self._cancel_ids = cancel_ids
        self._opened = False
        self._closed = False
        self._complete = False

    def __aiter__(self) -> StreamBody:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        if not self._opened:
            self._opened = True
            self._ctx.stream_opened()
        try:
            event = await self._events.__anext__()
        except StopAsyncIteration:
            self._complete = True
            self._close()
            raise
        except BaseException:
            self._close()
            raise
        return encode(event)

    async def aclose(self) -> None:
        self._close()
        await self._events.aclose()

    def __del__(self) -> None:
        # The safety net for a client that leaves between the route's return and the
        # first read of the body: Quart then drops the response without iterating or
        # closing it, and the request would run on for nobody.
        if not self._closed:
            try:
                self._close()
            except Exception:  # at interpreter exit the engine may be gone
                pass

    def _close(self) -> None:
        """Synchronous, idempotent: count the stream closed, cancel if it ended early."""
        if self._closed:
            return
        self._closed = True
        if self._opened:
            self._ctx.stream_closed()
        if self._complete:
            return
        ids = self._cancel_ids() if callable(self._cancel_ids) else self._cancel_ids
        reason = disconnect_reason()
        for request_id in ids:
            if self._ctx.engine.cancel_nowait(request_id, reason=reason):
                log.info(
                    "stream closed by the client: cancelled %s (reason %s)", request_id, reason
                )


def sse_response(body: StreamBody, request_id: str) -> Response:
    response = Response(
        body,  # type: ignore[arg-type]
        status=200,
        content_type="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Request-Id": request_id,
        },
    )
    response.timeout = None  # a stream lasts as long as its request
    return response
