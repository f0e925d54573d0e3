"""What one replica among several does with a call before its own app sees it.

`AmongPeers.answer_here` answers or forwards the calls that concern other replicas: an
id in the path that another replica generated (forwarded to the owner's direct
address while it drains, else a 404 saying it is gone); `/stats`, `/metrics` and
`GET /requests` gathered from every replica (`Peers.each`) unless one is named; a body
that names a parent on another replica, or a `previous_response_id` it stores,
forwarded there. `tagged` marks a response with the replica that answered. `Peers` is
how this replica reaches the others (through Serve).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, Protocol

from .ids import REPLICA_HEADER, path_id, routing_key
from .merge import merge_metrics, merge_stats
from .messages import (
    Message,
    Receive,
    Send,
    capture,
    error_body,
    is_forwarded,
    json_answer,
    parent_owner,
    read_body,
    replay,
    replay_body,
)

log = logging.getLogger("kvscope.replicas")

#: The routes whose answer gathers every replica's own (unless one is named).
GATHERED = ("/stats", "/metrics", "/requests")


class Peers(Protocol):
    """Every replica of the deployment, as this one reaches them (through Serve)."""

    async def each(self, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, bytes]:
        """Replica name -> the body of its own `GET path`, for every replica that answers."""
        ...

    def forward(
        self, replica: str, scope: Message, body: bytes, via: str | None = None
    ) -> AsyncGenerator[Message, None]:
        """Make the HTTP call (`scope`, `body`) on `replica`; its ASGI messages as they
        come. Through Serve, or `via` the replica's direct address; one that cannot be
        reached raises `ConnectionError` before any message."""
        ...

    async def reach(self, replica: str) -> str | None:
        """`replica`'s direct address (see `direct`), or None if it published none."""
        ...

    async def publish(self, replica: str, address: str | None) -> bool:
        """Publish a replica's direct address (None withdraws it); False if that could
        not be done (best effort: never raises)."""
        ...

    def connect(self, replica: str, scope: Message) -> AbstractAsyncContextManager[Any]:
        """Open the WebSocket of `scope` on `replica` (a `websockets` connection)."""
        ...


class AmongPeers:
    """The calls a replica answers or forwards itself (`answer_here`), around the app
    (`app()`, None while the replica does not serve) and `call_app`, which runs it."""

    def __init__(
        self,
        replica: str,
        peers: Peers,
        app: Callable[[], Any],
        call_app: Callable[[Message, Receive, Send], Awaitable[None]],
    ) -> None:
        self.replica = replica
        self.peers = peers
        self._app = app
        self._call_app = call_app

    async def answer_here(self, scope: Message, receive: Receive, send: Send) -> bool:
        path, method = scope["path"], scope["method"]
        target = routing_key(path, scope.get("query_string", b""), scope.get("headers", ()))
        named = path_id(path)
        if named is not None and target not in (None, self.replica):
            if not is_forwarded(scope) and await self._forward_direct(target, scope, receive, send):
                return True
            what = "response" if named.startswith("resp_") else "request"
            message = (
                f"no {what} {named!r}: it belongs to replica {target}, which is not "
                "running (it died or was replaced, and its requests with it)"
            )
            await json_answer(send, 404, error_body(message, "not_found_error"))
            return True
        if method == "GET" and path in GATHERED and target is None:
            await self._aggregate(path, scope, receive, send)
            return True
        if method == "GET" and path == "/stats":  # this replica's own, named
            answer = await capture(self._app(), scope, receive)
            if answer["status"] != 200:
                await replay(answer["messages"], send)
            else:
                stats = json.loads(answer["body"])
                stats.update(replica=self.replica, pid=os.getpid())
                await json_answer(tagged(send, self.replica), 200, stats)
            return True
        if method == "POST" and path in ("/generate", "/v1/responses"):
            return await self._forward_to_parent(scope, receive, send)
        return False

    async def _aggregate(self, path: str, scope: Message, receive: Receive, send: Send) -> None:
        # Authentication first: the local app answers 401 for a bad key.
        probe = await capture(self._app(), {**scope}, receive)
        if probe["status"] != 200:
            await replay(probe["messages"], send)
            return
        auth = [(k, v) for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        bodies = await self.peers.each(path, auth)
        if path == "/stats":
            await json_answer(send, 200, merge_stats({r: json.loads(b) for r, b in bodies.items()}))
        elif path == "/requests":
            live = [item for body in bodies.values() for item in json.loads(body)["requests"]]
            await json_answer(send, 200, {"requests": live})
        else:
            text = merge_metrics({r: b.decode() for r, b in bodies.items()})
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
                }
            )
            await send({"type": "http.response.body", "body": text.encode()})

    async def _forward_direct(
        self, owner: str, scope: Message, receive: Receive, send: Send
    ) -> bool:
        """A call for `owner`'s request that Serve did not route there: `owner` is
        draining (or gone). Forward it to `owner`'s direct address; False if `owner`
        published none or cannot be reached (it is gone)."""
        address = await self.peers.reach(owner)
        if address is None:
            return False
        body = await read_body(receive)
        if body is None:
            return True  # the client left
        try:
            async with aclosing(self.peers.forward(owner, scope, body, via=address)) as messages:
                async for message in messages:
                    await send(message)
        except ConnectionError as exc:
            log.info("replica %s is gone (nothing at %s): %r", owner, address, exc)
            await self.peers.publish(owner, None)  # it died without withdrawing it
            return False
        return True

    async def _forward_to_parent(self, scope: Message, receive: Receive, send: Send) -> bool:
        body = await read_body(receive)
        if body is None:
            return True
        owner = parent_owner(body)
        forwarded = is_forwarded(scope)
        # A forwarded call runs here even if this is not (or no longer) the owner: the
        # engine then answers 404 for the parent, and nothing is forwarded twice.
        if owner is None or owner == self.replica or forwarded:
            await self._call_app(scope, replay_body(body, receive), tagged(send, self.replica))
            return True
        # Closed in this task however the loop ends: a cancelled call (the client went
        # away) closes the forward's connection, which the owner sees as a disconnect.
        async with aclosing(self.peers.forward(owner, scope, body)) as messages:
            async for message in messages:
                await send(message)
        return True


def tagged(send: Send, replica: str) -> Send:
    """Responses say which replica answered (`X-Kvscope-Replica`) and repeat the
    kvscope id in `X-Kvscope-Request-Id` (as it was before `X-Request-Id` carried
    it alone through Serve's proxy)."""

    async def send_tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            headers.append((REPLICA_HEADER.encode(), replica.encode()))
            headers += [
                (b"x-kvscope-request-id", value)
                for name, value in message.get("headers", [])
                if name.lower() == b"x-request-id"
            ]
            message = {**message, "headers": headers}
        await send(message)

    return send_tagged
