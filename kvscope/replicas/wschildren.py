"""A WebSocket body naming a parent on another replica runs on the parent's replica.

Serve routes a WebSocket once, when it opens, by its path and headers; its bodies
come later, on the socket. `ChildForwarder` sits between the socket and the Quart
app. A generate body whose `parent` another replica owns is not given to the app: it
opens a WebSocket to the owner through the proxy (`Peers.connect`: the router's
`X-Kvscope-Replica: <owner>`, and `X-Kvscope-Forwarded` so it is never forwarded
again), sends the body there and relays, the owner's events to the client and the
client's messages (a cancel) to the owner, until the request's `done` (or an `error`
before its `start`: the owner refused the body). Then the socket is the app's again,
for the next body. The child starts inside its parent's scope on the owner, so
cancelling the parent cancels it by scope nesting, as for HTTP children.

A client that goes away ends the relay and closes the owner's socket (`async with`,
however the relay ends, Serve's cancellation included), which the owner sees as a
disconnect: reason `disconnect` there. An owner that stops answering mid-request
ends it on the client's socket with an error event naming the replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from .messages import Message, Receive, Send, error_body, parent_owner

log = logging.getLogger("kvscope.replicas")


class ChildForwarder:
    """`receive` for the app of one WebSocket call on `replica` (see the module)."""

    def __init__(self, replica: str, peers: Any, scope: Message, receive: Receive, send: Send):
        self.replica = replica
        self.peers = peers
        self.scope = scope
        self._receive = receive
        self._send = send
        #: The client's next message, asked for and not yet used: kept across calls,
        #: because a `receive` cancelled halfway could lose the message it was getting.
        self._next: asyncio.Future[Message] | None = None

    async def receive(self) -> Message:
        while True:
            message = await self._client()
            owner = self._foreign_parent(message)
            if owner is None:
                return message
            ended = await self._relay(owner, message)
            if ended is not None:  # the client went away during the relay
                return ended

    def close(self) -> None:
        """The call ended: drop the message still being asked for."""
        if self._next is not None:
            self._next.cancel()

    async def _client(self) -> Message:
        if self._next is None:
            self._next = asyncio.ensure_future(self._receive())
        message = await asyncio.shield(self._next)
        self._next = None
        return message

    def _foreign_parent(self, message: Message) -> str | None:
        if message["type"] != "websocket.receive":
            return None
        data = message.get("text") or message.get("bytes")
        owner = parent_owner(data) if data else None
        return owner if owner != self.replica else None

    async def _relay(self, owner: str, first: Message) -> Message | None:
        """Run one request on `owner`; the client's disconnect message if it went away."""
        try:
            async with self.peers.connect(owner, self.scope) as upstream:
                await upstream.send(first.get("text") or first.get("bytes"))
                to_client = asyncio.ensure_future(self._to_client(owner, upstream))
                try:
                    return await self._to_owner(upstream, to_client)
                finally:
                    to_client.cancel()
        except Exception as exc:  # websockets' own: refused, or cut; this socket stays open
            log.warning("the relay of a child to replica %s failed: %r", owner, exc)
            await self._event(_cut(None, owner))
            return None

    async def _to_owner(self, upstream: Any, to_client: asyncio.Future[None]) -> Message | None:
        """The client's messages to the owner until the request ends (None) or the
        client goes away (its disconnect message)."""
        while True:
            if self._next is None:
                self._next = asyncio.ensure_future(self._receive())
            either: list[asyncio.Future[Any]] = [self._next, to_client]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if to_client.done():
                to_client.result()
                return None
            message = self._next.result()
            self._next = None
            if message["type"] != "websocket.receive":
                return message
            await upstream.send(message.get("text") or message.get("bytes"))

    async def _to_client(self, owner: str, upstream: Any) -> None:
        """The owner's events to the client, until the request's last one."""
        request_id: str | None = None
        try:
            async for data in upstream:
                key = "text" if isinstance(data, str) else "bytes"
                await self._send({"type": "websocket.send", key: data})
                event = _event_of(data)
                kind = event.get("type")
                if kind == "start":
                    request_id = event.get("id")
                if kind == "done" or (kind == "error" and request_id is None):
                    return
        except Exception as exc:  # the connection to the owner failed (websockets' errors)
            log.warning("the relay of %s from replica %s failed: %r", request_id, owner, exc)
        await self._event(_cut(request_id, owner))

    async def _event(self, event: dict[str, Any]) -> None:
        text = json.dumps(event, separators=(",", ":"))
        await self._send({"type": "websocket.send", "text": text})


def _event_of(data: str | bytes) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


def _cut(request_id: str | None, owner: str) -> dict[str, Any]:
    message = (
        f"the request {request_id or '(not started)'} ran on replica {owner}, its parent's, "
        "which stopped answering (it died, or is shutting down)"
    )
    return {"type": "error", "id": request_id, **error_body(message, "replica_error")}
