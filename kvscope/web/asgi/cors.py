"""Cross-origin requests from a browser (CORS), for the origins `--allowed-origins` names.

vLLM's options of the same names (`--allowed-origins`, `--allowed-methods`,
`--allowed-headers`, `--allow-credentials`), with one difference: vLLM allows every
origin unless told, kvscope none (`docs/security.md`: a page on any site the user
opens could otherwise drive a server on their machine and read its answers).

`Cors` is the outermost ASGI layer, in front of `BodyGuard`: a preflight (`OPTIONS`
with `Access-Control-Request-Method`) carries no key, so it is answered here, and
every other answer to an allowed origin, a 401 or a fast-path `DELETE` included,
gets the headers that let the page read it. A request from an origin not allowed goes
on untouched: the browser, not the server, withholds the answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import attrs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: How long a browser may keep a preflight's answer, in seconds (Starlette's default).
PREFLIGHT_MAX_AGE = 600


@attrs.frozen
class CorsPolicy:
    """Who may call from a browser: origins (`*`: any), methods and request headers
    (`*`: any), and whether with credentials (cookies, HTTP auth)."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def allow_origin(self, origin: str) -> str:
        """The `Access-Control-Allow-Origin` value: `*` only where any origin may call
        without credentials (a browser refuses `*` with them)."""
        return "*" if "*" in self.origins and not self.credentials else origin

    def preflight_headers(self, origin: str, asked_headers: str) -> list[tuple[bytes, bytes]]:
        methods = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
        if "*" not in self.methods:
            methods = ", ".join(self.methods)
        allowed = asked_headers if "*" in self.headers else ", ".join(self.headers)
        out = [
            *self.answer_headers(origin),
            (b"access-control-allow-methods", methods.encode()),
            (b"access-control-max-age", str(PREFLIGHT_MAX_AGE).encode()),
        ]
        if allowed:
            out.append((b"access-control-allow-headers", allowed.encode("latin-1")))
        return out

    def answer_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        value = self.allow_origin(origin)
        out = [(b"access-control-allow-origin", value.encode("latin-1"))]
        if value != "*":
            out.append((b"vary", b"Origin"))
        if self.credentials:
            out.append((b"access-control-allow-credentials", b"true"))
        return out

    def allows_preflight(self, method: str, asked_headers: str) -> bool:
        if "*" not in self.methods and method.upper() not in self.methods:
            return False
        if "*" in self.headers or not asked_headers:
            return True
        allowed = {h.lower() for h in self.headers}
        return all(h.strip().lower() in allowed for h in asked_headers.split(",") if h.strip())


class Cors:
    """The app behind `policy`'s CORS answers (`create_app` puts it there only where the
    policy allows an origin)."""

    def __init__(self, app: Any, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        origin = headers.get("origin")
        if origin is None or not self.policy.allows(origin):
            return await self.app(scope, receive, send)
        asked_method = headers.get("access-control-request-method")
        if scope["method"] == "OPTIONS" and asked_method is not None:
            return await self._preflight(origin, asked_method, headers, send)
        extra = self.policy.answer_headers(origin)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, with_headers)

    async def _preflight(
        self, origin: str, method: str, headers: dict[str, str], send: Send
    ) -> None:
        asked = headers.get("access-control-request-headers", "")
        if self.policy.allows_preflight(method, asked):
            status, out = 200, self.policy.preflight_headers(origin, asked)
        else:  # a browser reads the missing allow headers as the refusal
            status, out = 400, [(b"content-type", b"text/plain; charset=utf-8")]
        body = b"" if status == 200 else b"CORS preflight refused: method or headers not allowed"
        out.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})


def _headers(scope: Scope) -> dict[str, str]:
    return {
        name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]
    }
