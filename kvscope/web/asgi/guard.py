"""The ASGI guard in front of the app: refuse a request before any of its body is read.

Quart starts reading a request's body (into memory, up to `MAX_CONTENT_LENGTH`) as
soon as the request arrives, in parallel with its handler, so a check in a
`before_request` hook comes too late to spare the server an unauthenticated client's
body. The guard sees only the headers: with API keys configured, a request to a
non-public path without a valid key is answered 401, and a `Content-Length` above
`max_body_bytes` 413, without reading the body; both close the connection, so the
unread rest of the body goes with it. What passes goes to the app unchanged (which
authenticates again, to know the key's id, and still caps a streamed body while it
reads it). WebSocket handshakes have no body; the app refuses them (401) itself.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import trio

from ..auth import is_public, key_of
from ..errors import ApiError, error_body
from ..settings import ServerSettings

Scope = dict[str, Any]


class BodyGuard:
    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await _send_error(send, scope["path"], refusal)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ApiError | None:
        headers = {name.lower(): value for name, value in scope["headers"]}
        if not is_public(scope["path"]):
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            try:
                key_of(authorization, self.settings.api_keys)
            except ApiError as error:
                return error
        length = headers.get(b"content-length", b"").strip()
        if length.isdigit() and int(length) > self.settings.max_body_bytes:
            return ApiError(
                413,
                f"the body has {int(length)} bytes; the limit (max_body_bytes) is "
                f"{self.settings.max_body_bytes}",
                "request_too_large",
            )
        return None


#: What sending raises once the client has gone. hypercorn on trio passes trio's own,
#: and when a client hangs up mid-body hypercorn answers that with its own 400 on the
#: same socket, so our send finds the socket busy.
_GONE: tuple[type[BaseException], ...] = (
    OSError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.BusyResourceError,
)


async def _send_error(send: Any, path: str, error: ApiError) -> None:
    body = json.dumps(
        error_body(error.message, error.type, openai=path.startswith("/v1/"))
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # the body was not read: do not reuse the connection
        *((name.lower().encode(), value.encode()) for name, value in error.headers.items()),
    ]
    try:
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except _GONE:
        pass  # the client hung up before hearing the refusal: nothing left to do
