"""The server's shared state, reached from any route as `server()`.

`ServerContext` holds the open `Engine`, the settings, the metrics, the count of
open streams (SSE responses and WebSockets) so that shutdown can wait until every
stream has sent its final event, and the line in which requests wait for their turn
to be admitted (`admission_turn`). It is created inside the running event loop (anyio
events bind to it) and stored in `app.extensions["kvscope"]`.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

import anyio
from quart import current_app

from kvscope import Engine

from .ops.metrics import Metrics
from .parsers.reasoning import ReasoningParser
from .parsers.tool_calls import parser_for
from .settings import ServerSettings

#: When the serving layer in front gives up on the current HTTP call (time.monotonic());
#: None when nothing does. Ray Serve's request timeout sets it (kvscope.replicas), so
#: a stream it cuts at its deadline is cancelled with reason `timeout`.
call_deadline: ContextVar[float | None] = ContextVar("kvscope_call_deadline", default=None)


def disconnect_reason() -> str:
    """Why the client's side of the current call ended early: `timeout` once past
    `call_deadline`, else `disconnect`."""
    deadline = call_deadline.get()
    return "timeout" if deadline is not None and time.monotonic() >= deadline else "disconnect"


class ServerContext:
    def __init__(self, engine: Engine, settings: ServerSettings, metrics: Metrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.started = int(time.time())
        #: How `tool_choice: auto` reads calls (`settings.tool_call_parser`).
        self.tool_parser = parser_for(settings.tool_call_parser, engine.loaded.chat_template)
        #: How a thinking model's reasoning is told from its answer.
        self.reasoning = ReasoningParser(settings.reasoning_parser)
        #: Set once shutdown began: WebSockets stop waiting for new bodies.
        self.shutting_down = anyio.Event()
        self.open_streams = 0
        self._streams_closed = anyio.Event()
        self._streams_closed.set()
        self._admissions = anyio.Lock()

    def stream_opened(self) -> None:
        if self.open_streams == 0:
            self._streams_closed = anyio.Event()
        self.open_streams += 1
        self.metrics.open_streams = self.open_streams

    def stream_closed(self) -> None:
        self.open_streams -= 1
        self.metrics.open_streams = self.open_streams
        if self.open_streams == 0:
            self._streams_closed.set()

    async def wait_streams_closed(self) -> None:
        """Wait until no SSE response or WebSocket is open."""
        await self._streams_closed.wait()

    async def admission_turn(self) -> None:
        """Wait for this request's turn: admissions go one to a pass of the event loop.

        Parsing and checking a body and submitting its job takes ~0.4-0.5 ms of the loop
        here (512 prompt tokens). A client that opened 32 streams at once had them all
        admitted in one pass, in which the loop served nothing else: the loop-lag
        monitor, and any `DELETE` arriving then, waited 14-22 ms (`bench cancel`;
        docs/benchmarks/README.md, "Measured settings": admissions one a pass). In this
        line the lock goes straight to the next waiter, who runs in the next pass, so
        whatever else is ready runs after at most one admission.
        The lock guards no work: what follows this call runs in the pass it returned
        in, while the line moves on in the next.
        """
        async with self._admissions:
            pass


def server() -> ServerContext:
    return current_app.extensions["kvscope"]  # type: ignore[no-any-return]
