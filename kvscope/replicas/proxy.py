"""In Ray Serve's HTTP proxy: a response's `X-Request-Id` is kvscope's id alone, an SSE
stream cut mid-way ends with an error event (and, from prefix.py, a generation call
gets its prompt's prefix key).

Serve's proxy appends its own request id to every response's `X-Request-Id` (its
`RequestIdMiddleware`, innermost, under the callback's middlewares); after the
replica's own, a client read `req-..., <Serve's id>`, which `GET /requests/{id}`
cannot find. `RequestIdMiddleware` here keeps the first value, the replica's (kvscope's
id), and drops Serve's; a response with no kvscope id keeps Serve's. Serve's id can
not be set to kvscope's instead: the replica generates that id after routing.

When the replica serving a stream dies (or Serve's request timeout passes), the
proxy stops sending and the client's connection is cut without a last event.
`StreamEndMiddleware`, installed in the proxy by Serve's proxy callback
(`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=kvscope.replicas.proxy:proxy_middlewares`
in the environment of Ray's processes; `kvscope serve --replicas` sets it), watches
each `text/event-stream` response; if the proxy's app returns before the body ended,
it sends one last event, `{"type":"error","id":...,"error":{...}}`, naming the request
and its replica, and ends the body properly, so a client reading events learns why.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("kvscope.replicas")

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "kvscope.replicas.proxy:proxy_middlewares"


def proxy_middlewares() -> list[Any]:
    """Serve's HTTP proxy callback: the middlewares it wraps its app in."""
    from starlette.middleware import Middleware

    from .prefix import PrefixKeyMiddleware

    return [
        Middleware(StreamEndMiddleware),
        Middleware(PrefixKeyMiddleware),
        Middleware(RequestIdMiddleware),
    ]


Message = dict[str, Any]


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_one_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": one_request_id(message.get("headers", []))}
            await send(message)

        await self.app(scope, receive, send_one_id)


def one_request_id(headers: Any) -> list[tuple[bytes, bytes]]:
    """`headers` with only the first `X-Request-Id` (the replica's, before Serve's)."""
    kept, seen = [], False
    for name, value in headers:
        if name.lower() == b"x-request-id":
            if seen:
                continue
            seen = True
        kept.append((name, value))
    return kept


class StreamEndMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stream: dict[str, Any] = {}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                    stream["id"] = headers.get(b"x-kvscope-request-id", b"").decode()
                    stream["replica"] = headers.get(b"x-kvscope-replica", b"").decode()
                    stream["open"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                stream["open"] = False
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if not stream.get("open"):
                raise
            log.exception("the stream of %s failed in the proxy", stream.get("id"))
        if stream.get("open"):
            await send(
                {"type": "http.response.body", "body": _error_event(stream), "more_body": True}
            )
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error_event(stream: dict[str, Any]) -> bytes:
    message = (
        f"the stream of request {stream['id']} was cut before its end: replica "
        f"{stream['replica']} stopped answering (it died, or Serve's request timeout passed)"
    )
    event = {
        "type": "error",
        "id": stream["id"] or None,
        "error": {"message": message, "type": "replica_error"},
    }
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
