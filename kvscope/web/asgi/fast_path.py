"""The answers the server owes at once, given below Quart: `DELETE /requests/{id}`
(the cancel), and `GET /stats` and `GET /health`, which dashboards, load balancers
and `bench cancel` poll many times a second.

Quart's request and app contexts, its dispatch and the app's before-request hooks
were most of a DELETE's time in the server. Measured on this 2-core machine, idle
server, one raw HTTP/1.1 client, p50 of `DELETE /requests/unknown`: through Quart
2.69 ms with 10 ms between requests (1.22 ms back to back); here 1.60 ms (0.52 ms),
as fast as a bare ASGI app on hypercorn (1.49 ms, 0.56 ms). A `GET /stats` took 1.1 ms
of the server's CPU through Quart, all of it on the event loop in one go, and polled at
20 Hz it was the largest of the loop's long passes under load. `FastPath`, an ASGI
layer in front of the app and behind `BodyGuard` (which has already refused a request
without a valid key), answers these bodiless requests itself with the same rule and
the same JSON as their Quart routes (`native.jobs.cancel_answer`,
`ops.observability.stats_answer`, `ops.observability.health_answer`: one place for each).
Anything else, any of them sent with a body included, goes on to the app unchanged, so
the routes in the OpenAPI document are still the ones that answer when this layer
steps aside.
"""

from __future__ import annotations

import logging
from typing import Any

from kvscope import errors as engine_errors

from ..auth import key_of
from ..context import ServerContext
from ..errors import ApiError, error_body, from_engine
from ..native.jobs import cancel_answer
from ..ops.observability import health_answer, stats_answer
from ..sse import dumps

log = logging.getLogger("kvscope.web")

PREFIX = "/requests/"


class FastPath:
    def __init__(self, app: Any, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not answered_here(scope):
            await self.app(scope, receive, send)
            return
        extra: dict[str, str] = {}
        try:
            status, body = await self._answer(scope)
        except Exception as exc:
            error = _api_error(exc, self.ctx.settings.retry_after, scope)
            status, body = error.status, error_body(error.message, error.type)
            extra = error.headers
        data = dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(data)),
            *((name.lower().encode(), value.encode()) for name, value in extra.items()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    async def _answer(self, scope: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        path: str = scope["path"]
        if path == "/stats":
            return stats_answer(self.ctx)
        if path == "/health":
            return health_answer(self.ctx)
        owner = key_of(_header(scope, b"authorization"), self.ctx.settings.api_keys)
        return await cancel_answer(self.ctx, path[len(PREFIX) :], owner)


def _api_error(exc: Exception, retry_after: int, scope: dict[str, Any]) -> ApiError:
    """The answer to an exception, as the app's error handlers give it (`errors.py`)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, engine_errors.KvscopeError):
        return from_engine(exc, retry_after=retry_after)
    log.exception("unhandled error on %s %s", scope["method"], scope["path"])
    return ApiError(500, "internal server error", "internal_error")


def answered_here(scope: dict[str, Any]) -> bool:
    """A bodiless `DELETE /requests/{id}`, `GET /stats` or `GET /health`."""
    if scope["type"] != "http":
        return False
    method, path = scope["method"], scope["path"]
    if method == "GET":
        wanted = path in ("/stats", "/health")
    elif method == "DELETE" and path.startswith(PREFIX):
        wanted = len(path) > len(PREFIX) and "/" not in path[len(PREFIX) :]
    else:
        wanted = False
    length = _header(scope, b"content-length")
    bodiless = _header(scope, b"transfer-encoding") is None and length in (None, "0")
    return wanted and bodiless  # with a body to read first, the app answers


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None
