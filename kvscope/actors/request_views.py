"""What a request shows outside the engine: its `Completion` once released
(`completion_of`, what a handle's `result` is) and its `RequestInfo` (`info_of`, what a
look-up by id or a listing shows), both frozen copies of its `RequestState`.
"""

from __future__ import annotations

from .messages import Completion, RequestInfo
from .request import RequestState


def completion_of(state: RequestState) -> Completion:
    """Its `Completion`; `RuntimeError` while it runs."""
    if not state.is_released:
        raise RuntimeError(f"request {state.id} has not ended yet")
    return Completion(
        id=state.id,
        text=state.text,
        token_ids=tuple(state.token_ids),
        finish_reason=state.finish_reason or "cancelled",
        prompt_tokens=state.num_prompt_tokens,
        cached_tokens=state.seq.num_cached_prompt or 0,
        cancel_reason=state.cancel_reason,
        error=state.error,
        logprobs=tuple(state.logprobs) if state.logprobs is not None else None,
        prompt_logprobs=(
            tuple(state.prompt_logprobs) if state.prompt_logprobs is not None else None
        ),
        embedding=_embedding(state),
    )


def info_of(state: RequestState) -> RequestInfo:
    """What a look-up by id shows of it, live or ended."""
    return RequestInfo(
        id=state.id,
        status=state.public_status,
        text=state.text,
        token_ids=tuple(state.token_ids),
        prompt_tokens=state.num_prompt_tokens,
        finish_reason=state.finish_reason,
        cancel_reason=state.cancel_reason,
        cancelled_by=state.cancelled_by,
        parent=state.parent.id if state.parent is not None else None,
        children=tuple(c.id for c in state.children),
        priority=state.priority,
        owner=state.owner,
        created=state.created_wall,
        error=state.error,
        embedding=_embedding(state),
    )


def _embedding(state: RequestState) -> tuple[float, ...] | None:
    return tuple(state.embedding) if state.embedding is not None else None
