"""`--root-path` (vLLM's, uvicorn's): the server also answers under a path prefix, as
behind a proxy that forwards `/llm/v1/...` without stripping `/llm`.

`RootPath` is the outermost ASGI layer: a request whose path starts with the prefix
goes on without it, so every layer and route below sees `/v1/...` (the fast path's
`DELETE /requests/{id}` included); any other path goes on as it came, so `/v1/...` is
answered too, as vLLM answers both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]


def checked_root_path(value: str) -> str:
    """`value` as a prefix: empty (none), or `/name...` without a trailing slash."""
    prefix = value.rstrip("/")
    if prefix and not prefix.startswith("/"):
        raise ValueError(f"root_path must start with '/', not {value!r}")
    return prefix


class RootPath:
    def __init__(self, app: App, prefix: str) -> None:
        self.app, self.prefix = app, checked_root_path(prefix)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (
            path == self.prefix or path.startswith(self.prefix + "/")
        ):
            # Quart reads `path` less `root_path` only where `path` holds it, so the
            # prefix is dropped from `path` alone: the layers and routes below match
            # `/v1/...` either way.
            scope = dict(scope)
            scope["path"] = path[len(self.prefix) :] or "/"
            raw = scope.get("raw_path")
            if isinstance(raw, bytes) and raw.startswith(self.prefix.encode()):
                scope["raw_path"] = raw[len(self.prefix) :] or b"/"
        await self.app(scope, receive, send)
