"""The native jobs API: start, list, look up and cancel requests by id.

`POST /generate` starts a detached job (202 with its id) or, with `"stream": true`,
answers an SSE stream of its tokens whose disconnect cancels it. `DELETE
/requests/{id}` cancels a request and its children (reason `user`, the caller's key as
who asked). A key sees only its own requests: another key's id answers 404.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, jsonify
from quart_schema import document_request, document_response

from ..auth import current_owner, visible, visible_to
from ..bodies import read_body
from ..context import ServerContext, server
from ..errors import ApiError
from ..sse import StreamBody, sse_response
from .events import request_events
from .schemas import (
    Accepted,
    CancelReportView,
    ErrorBody,
    GenerateBody,
    RequestList,
    RequestView,
    request_view,
)

blueprint = Blueprint("jobs", __name__)


@blueprint.post("/generate")
@document_request(GenerateBody)
@document_response(Accepted, 202)
@document_response(ErrorBody, 400)
async def generate() -> Any:
    """Start a generation: 202 with its id, or an SSE stream of token events with
    `"stream": true` (closing that stream cancels the request)."""
    body = await read_body(GenerateBody)
    ctx = server()
    job = await ctx.engine.submit(
        body.engine_prompt(),
        priority=body.priority,
        parent=body.parent,
        timeout=body.timeout,
        owner=current_owner(),
        **body.to_sampling_params(),
    )
    if not body.stream:
        return {"id": job.id, "status": job.info().status}, 202, {"Location": f"/requests/{job.id}"}
    events = request_events(ctx.engine, job.id, aiter(job))
    return sse_response(StreamBody(ctx, events, cancel_ids=[job.id]), job.id)


@blueprint.get("/requests")
@document_response(RequestList, 200)
async def list_requests() -> Any:
    """The caller's live requests (queued or running)."""
    infos = server().engine.list_requests(
        owner=current_owner() if server().settings.api_keys else None
    )
    return {"requests": [request_view(info.as_dict()) for info in infos]}


@blueprint.get("/requests/<request_id>")
@document_response(RequestView, 200)
@document_response(ErrorBody, 404)
async def get_request(request_id: str) -> Any:
    """A request's status, text so far, token counts, reasons, parent and children."""
    info = server().engine.get(request_id)
    if not visible(info):
        raise ApiError(404, f"no request {request_id!r}", "not_found_error")
    assert info is not None
    return request_view(info.as_dict())


@blueprint.delete("/requests/<request_id>")
@document_response(CancelReportView, 200)
@document_response(ErrorBody, 404)
@document_response(ErrorBody, 409)
async def cancel_request(request_id: str) -> Any:
    """Cancel a live request and its children: 200 with what was freed; 409 with its
    final status if it and all its children had already ended; 404 if unknown."""
    status, body = await cancel_answer(server(), request_id, current_owner())
    return jsonify(body), status


async def cancel_answer(
    ctx: ServerContext, request_id: str, owner: str | None
) -> tuple[int, dict[str, Any]]:
    """`DELETE /requests/{id}` for the key `owner`: the status and the JSON body (the
    rule in one place: this route and `asgi.fast_path.FastPath` both answer with it).
    Raises `ApiError(404)` for an id the key cannot see."""
    if not visible_to(ctx.engine.get(request_id), owner, ctx.settings.api_keys):
        raise ApiError(404, f"no request {request_id!r}", "not_found_error")
    report = await ctx.engine.cancel(request_id, reason="user", by=owner or "api")
    if not report.found:
        raise ApiError(404, f"no request {request_id!r}", "not_found_error")
    if report.status not in ("queued", "running") and not report.cancelled_children:
        # ended, and nothing of it was live
        return 409, {
            "error": {
                "message": f"request {request_id!r} has already ended ({report.status})",
                "type": "conflict_error",
                "status": report.status,
            }
        }
    return 200, report.as_dict()
