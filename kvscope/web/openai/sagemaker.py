"""Amazon SageMaker's container contract, as vLLM serves it: `GET` or `POST /ping`
(the health check, answered as `/health` is, without a key) and `POST /invocations`
(a body of any of the APIs, answered by the route its fields name: `messages` chat,
`prompt` completions, `input` embeddings, `query` and `documents` rerank, `text_1`
score). Everything else about the call (keys, errors, streams, cancelling on
disconnect) is that route's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from quart import Blueprint, request

from ..bodies import decode_json
from ..context import server
from ..errors import ApiError
from ..ops.observability import health_answer
from .completions import chat_completions, completions
from .embeddings import embeddings
from .scores import rerank, score

blueprint = Blueprint("sagemaker", __name__)

#: The route each field names, the first found in the body.
ROUTE_OF_FIELD: tuple[tuple[str, Callable[[], Awaitable[Any]]], ...] = (
    ("messages", chat_completions),
    ("prompt", completions),
    ("input", embeddings),
    ("documents", rerank),
    ("text_1", score),
)


@blueprint.route("/ping", methods=["GET", "POST"])
async def ping() -> Any:
    """SageMaker's health check: `/health`'s answer."""
    status, body = health_answer(server())
    return body, status


@blueprint.post("/invocations")
async def invocations() -> Any:
    """The body, answered by the route its fields name."""
    data = decode_json(await request.get_data())
    if isinstance(data, dict):
        for field, route in ROUTE_OF_FIELD:
            if field in data:
                return await route()
    names = ", ".join(field for field, _ in ROUTE_OF_FIELD)
    raise ApiError(400, f"an invocation's body names its API by a field: one of {names}")
