"""`WS /ws/generate`: generate over a WebSocket, one request at a time per socket.

The client sends a generate body (the `POST /generate` fields; `"type": "generate"`
optional) and receives `{"type":"start","id"}`, `{"type":"token",...}` events and
`{"type":"done",...}`; it may then send the next body. `{"type":"cancel"}` cancels the
running request (reason `user`); a bad message answers `{"type":"error",...}` and the
socket stays open. A disconnect cancels the running request (reason `disconnect`).

The connection is a task group of siblings (STYLE 10): the reader, one sender per
request, and a shutdown watcher that closes the socket (1001) once the server is
shutting down and the last `done` was sent. Whichever ends the connection cancels the
rest; the handler's `finally` cancels the running request synchronously.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from anyio.abc import TaskGroup
from quart import Blueprint, websocket

from kvscope import Engine, KvscopeError

from ..auth import current_owner
from ..bodies import decode_json, validate
from ..context import ServerContext, disconnect_reason, server
from ..errors import ApiError, from_engine
from ..sse import dumps
from .events import request_events
from .schemas import GenerateBody

log = logging.getLogger("kvscope.web")

blueprint = Blueprint("websocket", __name__)


class _Connection:
    def __init__(self, ctx: ServerContext, owner: str | None) -> None:
        self.ctx = ctx
        self.engine: Engine = ctx.engine
        self.owner = owner
        self.current: str | None = None
        self.idle = anyio.Event()
        self.idle.set()
        self._send_lock = anyio.Lock()

    async def send(self, event: dict[str, Any] | str) -> None:
        """Send an event (a dict, or JSON text as `request_events` yields it)."""
        text = event if isinstance(event, str) else dumps(event)
        async with self._send_lock:
            await websocket.send(text)

    async def send_error(self, error: ApiError, request_id: str | None = None) -> None:
        await self.send(
            {
                "type": "error",
                "id": request_id,
                "error": {"message": error.message, "type": error.type},
            }
        )

    async def read(self, tg: TaskGroup) -> None:
        """The reader: each message is a generate body or a cancel."""
        while True:
            message = await websocket.receive()
            try:
                data = decode_json(message)
                if isinstance(data, dict) and data.get("type") == "cancel":
                    await self.cancel()  # never waits in the admissions' line
                    continue
                if isinstance(data, dict) and data.get("type") == "generate":
                    data = {k: v for k, v in data.items() if k != "type"}
                await self.ctx.admission_turn()  # as a POST waits for its turn
                body = validate(GenerateBody, data)
                await self.start(body, tg)
            except ApiError as error:
                await self.send_error(error, self.current)
            except KvscopeError as exc:
                await self.send_error(from_engine(exc), self.current)

    async def start(self, body: GenerateBody, tg: TaskGroup) -> None:
        if self.current is not None:
            raise ApiError(
                409,
                "a generation is already running on this socket; cancel it first",
                "conflict_error",
            )
        job = await self.engine.submit(
            body.engine_prompt(),
            priority=body.priority,
            parent=body.parent,
            timeout=body.timeout,
            owner=self.owner,
            **body.to_sampling_params(),
        )
        self.current = job.id
        self.idle = anyio.Event()
        await self.send({"type": "start", "id": job.id})
        tg.start_soon(self.stream, job.id, aiter(job))

    async def stream(self, request_id: str, deltas: Any) -> None:
        """A sender: the request's events, then the socket is free for the next body."""
        async for event in request_events(self.engine, request_id, deltas):
            await self.send(event)
        self.current = None
        self.idle.set()

    async def cancel(self) -> None:
        if self.current is None:
            raise ApiError(409, "no generation is running on this socket", "conflict_error")
        await self.engine.cancel(self.current, reason="user", by=self.owner or "websocket")

    async def close_on_shutdown(self, tg: TaskGroup) -> None:
        await self.ctx.shutting_down.wait()
        await self.idle.wait()
        await websocket.close(1001, "server shutting down")
        tg.cancel_scope.cancel()

    def abandon(self) -> None:
        """Synchronous: the connection ended; cancel what still runs."""
        reason = disconnect_reason()
        if self.current is not None and self.engine.cancel_nowait(self.current, reason=reason):
            log.info("websocket closed: cancelled %s (reason %s)", self.current, reason)


@blueprint.websocket("/ws/generate")
async def ws_generate() -> None:
    """Generate over a WebSocket; see the module docstring for the protocol."""
    ctx = server()
    connection = _Connection(ctx, current_owner())
    await websocket.accept()
    ctx.stream_opened()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(connection.read, tg)
            tg.start_soon(connection.close_on_shutdown, tg)
    finally:
        connection.abandon()
        ctx.stream_closed()
