"""API keys: with keys configured, every route but `/health` (and the dashboard's
static shell, which holds no data) needs `Authorization: Bearer KEY`.

The key's id (see `settings.key_id`) becomes the owner of the requests it makes; a key
sees and cancels only its own requests, and another key's request answers 404, as if
it did not exist. Without keys every caller is the anonymous owner `None`.
"""

from __future__ import annotations

import hmac

from quart import Quart, g, request, websocket

from kvscope import RequestInfo

from .context import server
from .errors import ApiError


def is_public(path: str) -> bool:
    """Liveness and readiness (and SageMaker's `/ping`), and the dashboard's page (it
    asks for a key itself)."""
    return path in ("/health", "/ready", "/ping", "/") or path.startswith("/dashboard/")


def _authenticate(authorization: str | None) -> str | None:
    return key_of(authorization, server().settings.api_keys)


def key_of(authorization: str | None, keys: dict[str, str]) -> str | None:
    """The id of the key an `Authorization` header carries (None without keys);
    `ApiError(401)` if it carries none of `keys`."""
    if not keys:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        for kid, key in keys.items():
            if hmac.compare_digest(token.encode(), key.encode()):
                return kid
    raise ApiError(
        401,
        "a valid API key is required: send Authorization: Bearer KEY",
        "authentication_error",
        headers={"WWW-Authenticate": "Bearer"},
    )


def current_owner() -> str | None:
    """The id of the key that made this request (None without keys)."""
    return g.get("key_id")


def visible(info: RequestInfo | None) -> bool:
    """Whether the current caller may see (and cancel) this request."""
    return visible_to(info, current_owner(), server().settings.api_keys)


def visible_to(info: RequestInfo | None, owner: str | None, keys: dict[str, str]) -> bool:
    """Whether the key `owner` may see (and cancel) this request: any caller may without
    keys, else only the key that made it."""
    if info is None:
        return False
    return not keys or info.owner == owner


def register(app: Quart) -> None:
    @app.before_request
    async def _check_key() -> None:
        if not is_public(request.path):
            g.key_id = _authenticate(request.headers.get("Authorization"))

    @app.before_websocket
    async def _check_ws_key() -> None:
        g.key_id = _authenticate(websocket.headers.get("Authorization"))
