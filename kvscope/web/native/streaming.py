"""Watching a request: `GET /requests/{id}/events`, an SSE stream of its tokens from
its start, then its `done` event. A watcher is only a reader: its disconnect cancels
nothing (the streaming form of `POST /generate` is the one that owns its request).
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint
from quart_schema import document_response

from ..auth import visible
from ..context import server
from ..errors import ApiError
from ..sse import StreamBody, sse_response
from .events import request_events
from .schemas import ErrorBody

blueprint = Blueprint("streaming", __name__)


@blueprint.get("/requests/<request_id>/events")
@document_response(ErrorBody, 404)
async def watch_request(request_id: str) -> Any:
    """SSE: the request's token events from its start, then `done`."""
    ctx = server()
    if not visible(ctx.engine.get(request_id)):
        raise ApiError(404, f"no request {request_id!r}", "not_found_error")
    events = request_events(ctx.engine, request_id, ctx.engine.watch(request_id))
    return sse_response(StreamBody(ctx, events), request_id)
