"""The OpenAI-compatible API: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

The `n` samples of one call are one parent request (sample 0) and `n - 1` children
submitted with `parent=` it, so they share the prompt's KV blocks and cancelling the
parent cancels them all. A non-streaming call waits for every sample; if the client
goes away meanwhile, the handler's `finally` cancels them (reason `disconnect`). A
streaming call answers SSE chunks in OpenAI's format (each sample's chunks in turn,
told apart by `index`), then `data: [DONE]`; closing it cancels every sample. Errors
are in OpenAI's shape (see `errors`). The response `id` is the engine's id of sample 0:
`DELETE /requests/{id}` cancels the whole call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from quart import Blueprint
from quart_schema import document_request

from kvscope import Job, merge_streams

from .auth import current_owner
from .bodies import read_body
from .chat import chat_prompt
from .context import ServerContext, disconnect_reason, server
from .errors import ApiError
from .openai_schemas import ChatBody, CompletionBody, OpenAISampling
from .sse import StreamBody, sse_response

blueprint = Blueprint("openai", __name__, url_prefix="/v1")


@blueprint.get("/models")
async def list_models() -> Any:
    """The one model this server runs."""
    engine = server().engine
    return {
        "object": "list",
        "data": [
            {
                "id": engine.model_name,
                "object": "model",
                "created": server().started,
                "owned_by": "kvscope",
                "max_model_len": engine.max_model_len,
            }
        ],
    }


@blueprint.post("/completions")
@document_request(CompletionBody)
async def completions() -> Any:
    """OpenAI text completions (`stream`, `n`, `max_tokens`, `temperature`, `top_p`,
    `seed`, `stop`), with usage counts."""
    body = await read_body(CompletionBody)
    prompt = _single_prompt(body.prompt)
    return await _complete(server(), prompt, body, max_tokens=body.max_tokens or 16, chat=False)


@blueprint.post("/chat/completions")
@document_request(ChatBody)
async def chat_completions() -> Any:
    """OpenAI chat completions; the prompt is the model's chat template over `messages`."""
    body = await read_body(ChatBody)
    ctx = server()
    prompt = chat_prompt(ctx.engine, body.messages)
    max_tokens = body.max_completion_tokens or body.max_tokens or ctx.engine.max_model_len
    return await _complete(ctx, prompt, body, max_tokens=max_tokens, chat=True)


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return prompt  # type: ignore[return-value]
    if len(prompt) == 1:
        return prompt[0]  # type: ignore[return-value]
    raise ApiError(
        400, "send one prompt per request (batched prompts are not supported)", param="prompt"
    )


async def _start_samples(
    ctx: ServerContext, prompt: str | list[int], body: OpenAISampling, max_tokens: int
) -> list[Job]:
    """The `n` samples as one family: sample 0 the parent, the rest its children
    (the engine gives sample i the seed + i)."""
    return await ctx.engine.submit_samples(
        prompt, n=body.n, priority=body.priority, owner=current_owner(), **body.sampling(max_tokens)
    )


def _cancel_all(ctx: ServerContext, jobs: list[Job], reason: str) -> None:
    for job in reversed(jobs):  # children first, so each records this reason itself
        ctx.engine.cancel_nowait(job.id, reason=reason)


async def _complete(
    ctx: ServerContext,
    prompt: str | list[int],
    body: OpenAISampling,
    *,
    max_tokens: int,
    chat: bool,
) -> Any:
    jobs = await _start_samples(ctx, prompt, body, max_tokens)
    if body.stream:
        chunks = _chunks(ctx, jobs, body, chat=chat)
        ids = [job.id for job in reversed(jobs)]
        return sse_response(StreamBody(ctx, chunks, cancel_ids=ids), jobs[0].id)
    try:
        results = [await job.wait() for job in jobs]
    finally:
        if not all(job.done for job in jobs):
            _cancel_all(ctx, jobs, disconnect_reason())
    choices = []
    for index, result in enumerate(results):
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        choices.append(choice)
    prompt_tokens = results[0].prompt_tokens
    completion_tokens = sum(r.completion_tokens for r in results)
    return (
        {
            "id": jobs[0].id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": ctx.engine.model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        },
        200,
        {"X-Request-Id": jobs[0].id},
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _chunks(
    ctx: ServerContext, jobs: list[Job], body: OpenAISampling, *, chat: bool
) -> AsyncGenerator[dict[str, Any] | str, None]:
    """The SSE chunks of the samples as they arrive, the usage chunk if asked, `[DONE]`."""
    request_id, created, model = jobs[0].id, int(time.time()), ctx.engine.model_name
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(
        index: int, text: str | None, finish_reason: str | None, *, role: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": None}
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [choice],
        }

    completion_tokens = 0
    if chat:
        for index in range(len(jobs)):
            yield chunk(index, "", None, role=True)
    async for index, delta in merge_streams(jobs):  # the samples interleaved, as they come
        if delta is None:
            result = jobs[index].result
            completion_tokens += result.completion_tokens
            yield chunk(index, None if chat else "", result.finish_reason)
        elif delta.text:
            yield chunk(index, delta.text, None)
    if body.include_usage:
        yield {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [],
            "usage": _usage(jobs[0].result.prompt_tokens, completion_tokens),
        }
    yield "[DONE]"
