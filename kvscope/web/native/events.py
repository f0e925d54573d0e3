"""The JSON events every native stream carries (SSE `data:` lines, WebSocket messages).

Each is an object with a `type` and the request's `id`: `token` for each delta,
`done` once the request ended, with its final status and reasons. `request_events`
yields them as JSON text, encoded once for either transport. A token event is the
per-token path: `TokenEvents` fills a template built from the request's id with the
delta's text and token ids, giving the same text as `dumps(token_event(...))`
(tests/web/test_sse_body.py holds the two together); a delta with log-probabilities
(its tokens' or, on the first, the prompt's) takes the general path.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from json.encoder import encode_basestring_ascii
from typing import Any

from kvscope import Delta, Engine, TokenLogprobs

from ..sse import dumps

Event = dict[str, Any]


def token_event(request_id: str, delta: Delta) -> Event:
    event: Event = {
        "type": "token",
        "id": request_id,
        "text": delta.text,
        "token_ids": list(delta.token_ids),
    }
    if delta.logprobs:  # asked for with `logprobs`: one entry per token id
        event["logprobs"] = [_logprobs(lp) for lp in delta.logprobs]
    if delta.prompt_logprobs is not None:  # with `prompt_logprobs`, on the first token's
        event["prompt_logprobs"] = [
            None if lp is None else _logprobs(lp) for lp in delta.prompt_logprobs
        ]
    return event


def _logprobs(lp: TokenLogprobs) -> Event:
    return {"logprob": lp.logprob, "top": [[token, value] for token, value in lp.top]}


class TokenEvents:
    """`dumps(token_event(request_id, delta))`, from a template."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._open = dumps({"type": "token", "id": request_id})[:-1] + ',"text":'

    def json(self, delta: Delta) -> str:
        if delta.logprobs or delta.prompt_logprobs is not None:
            return dumps(token_event(self.request_id, delta))
        ids = ",".join(map(str, delta.token_ids))
        return f'{self._open}{encode_basestring_ascii(delta.text)},"token_ids":[{ids}]}}'


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
) -> AsyncGenerator[str, None]:
    """Token events for `deltas`, then the `done` event, as JSON text."""
    tokens = TokenEvents(request_id)
    async for delta in deltas:
        if delta.text or delta.token_ids:
            yield tokens.json(delta)
    yield dumps(done_event(engine, request_id))
