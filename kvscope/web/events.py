"""The JSON events every native stream carries (SSE `data:` lines, WebSocket messages).

Each is an object with a `type` and the request's `id`: `token` for each delta,
`done` once the request ended, with its final status and reasons.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvscope import Delta, Engine

Event = dict[str, Any]


def token_event(request_id: str, delta: Delta) -> Event:
    event: Event = {
        "type": "token",
        "id": request_id,
        "text": delta.text,
        "token_ids": list(delta.token_ids),
    }
    if delta.logprobs:  # asked for with `logprobs`: one entry per token id
        event["logprobs"] = [
            {"logprob": lp.logprob, "top": [[token, value] for token, value in lp.top]}
            for lp in delta.logprobs
        ]
    return event


def done_event(engine: Engine, request_id: str) -> Event:
    info = engine.get(request_id)
    if info is None:  # dropped from the bounded history meanwhile
        return {"type": "done", "id": request_id, "status": "unknown"}
    return {
        "type": "done",
        "id": request_id,
        "status": info.status,
        "finish_reason": info.finish_reason,
        "cancel_reason": info.cancel_reason if info.status == "cancelled" else None,
        "cancelled_by": info.cancelled_by if info.status == "cancelled" else None,
        "text": info.text,
        "prompt_tokens": info.prompt_tokens,
        "completion_tokens": info.tokens_generated,
        "error": info.error,
    }


async def request_events(
    engine: Engine, request_id: str, deltas: AsyncIterator[Delta]
) -> AsyncGenerator[Event, None]:
    """Token events for `deltas`, then the `done` event."""
    async for delta in deltas:
        if delta.text or delta.token_ids:
            yield token_event(request_id, delta)
    yield done_event(engine, request_id)
