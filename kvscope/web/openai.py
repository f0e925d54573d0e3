"""The OpenAI-compatible API: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

The `n` samples of one prompt are one parent request (sample 0) and `n - 1` children
submitted with `parent=` it, so they share the prompt's KV blocks and cancelling the
parent cancels them all. A batch of prompts on `/v1/completions` is one such family per
prompt (choice `i * n + j` is prompt i's sample j). A non-streaming call waits for every
sample; if the client goes away meanwhile, the handler's `finally` cancels them (reason
`disconnect`). A streaming call answers SSE chunks in OpenAI's format (told apart by
`index`), then `data: [DONE]`; closing it cancels every sample of every prompt. The
response `id` is the engine's id of the first prompt's sample 0: `DELETE
/requests/{id}` cancels that family.

What a body asks is honoured or refused with a 400 naming the field (`param`), never
ignored: unknown fields, a model this server does not run (404), `max_tokens` beyond
the context, a non-JSON `Content-Type`, `stream_options` without `stream`, `best_of`,
tools, `echo` with `logprobs` (prompt log-probabilities are not computed). Errors are
in OpenAI's shape (see `errors`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, TypeVar

import anyio
from quart import Blueprint, request
from quart_schema import document_request

from kvscope import Engine, Job, merge_streams
from kvscope.kernels.sampling import TokenLogprobs
from kvscope.params import SamplingParams, field_of

from .auth import current_owner
from .bodies import decode_json, validate
from .chat import chat_prompt
from .context import ServerContext, disconnect_reason, server
from .errors import ApiError
from .openai_schemas import ChatBody, CompletionBody, OpenAISampling
from .sse import StreamBody, sse_response

blueprint = Blueprint("openai", __name__, url_prefix="/v1")

B = TypeVar("B", bound=OpenAISampling)
Prompt = str | list[int]
#: The default `max_tokens` of `/v1/completions` (OpenAI's); chat's is what fits.
COMPLETION_MAX_TOKENS = 16


def _model_card(ctx: ServerContext) -> dict[str, Any]:
    engine = ctx.engine
    return {
        "id": engine.model_name,
        "object": "model",
        "created": ctx.started,
        "owned_by": "kvscope",
        "max_model_len": engine.max_model_len,
    }


@blueprint.get("/models")
async def list_models() -> Any:
    """The one model this server runs."""
    return {"object": "list", "data": [_model_card(server())]}


@blueprint.get("/models/<path:model_id>")
async def get_model(model_id: str) -> Any:
    """The model `model_id`, if this server runs it (404 otherwise)."""
    ctx = server()
    _check_model(ctx.engine, model_id)
    return _model_card(ctx)


@blueprint.post("/completions")
@document_request(CompletionBody)
async def completions() -> Any:
    """OpenAI text completions: one prompt or a batch, `n`, `stream`, `echo`, `logprobs`,
    the penalties, `logit_bias`, `seed`, `stop`, with usage counts."""
    ctx = server()
    body = await _read(CompletionBody)
    if body.best_of not in (None, 1):
        raise ApiError(400, "best_of is not supported (use n)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise ApiError(
            400, "echo with logprobs is not supported (no prompt logprobs)", param="echo"
        )
    prompts = [await _prompt_ids(ctx.engine, p) for p in _batch(body.prompt)]
    plans = [(ids, _max_tokens(ctx.engine, len(ids), body.max_tokens, "prompt")) for ids in prompts]
    echo = [ctx.engine.tokenizer.decode(ids) for ids in prompts] if body.echo else None
    return await _complete(ctx, plans, body, chat=False, echo=echo)


@blueprint.post("/chat/completions")
@document_request(ChatBody)
async def chat_completions() -> Any:
    """OpenAI chat completions; the prompt is the model's chat template over `messages`.
    Honours `n`, `stream`, `logprobs` / `top_logprobs`, the penalties, `logit_bias`,
    `seed`, `stop` and `response_format` (`json_object`, `json_schema`: constrained
    decoding); refuses `tools` and any `tool_choice` but `none`."""
    ctx = server()
    body = await _read(ChatBody)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.tools:
        raise ApiError(400, "tool calling is not supported", param="tools")
    if body.tool_choice not in (None, "none"):
        raise ApiError(
            400, 'tool calling is not supported (tool_choice "none" only)', param="tool_choice"
        )
    ids = await chat_prompt(ctx.engine, body.messages)
    asked = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    plan = (ids, _max_tokens(ctx.engine, len(ids), asked, "messages", param=param))
    return await _complete(ctx, [plan], body, chat=True)


# -- reading and checking a body ---------------------------------------------------------


async def _read(model: type[B]) -> B:
    """The body as `model`: JSON only, every field known, the model this one."""
    mimetype = request.mimetype
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise ApiError(400, f"Content-Type must be application/json, not {mimetype or 'none'!r}")
    data = decode_json(await request.get_data())
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(model.model_fields))
        if unknown:
            raise ApiError(400, f"{unknown[0]} is not supported by this server", param=unknown[0])
    body = validate(model, data)
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise ApiError(
            400, "a json_schema response_format needs json_schema", param="response_format"
        )
    if fmt is not None and fmt.type != "text" and body.guided_json is not None:
        raise ApiError(400, "give response_format or guided_json, not both", param="guided_json")
    engine = server().engine
    if body.model is not None:
        _check_model(engine, body.model)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options")
    return body


def _check_model(engine: Engine, name: str) -> None:
    if name != engine.model_name:
        raise ApiError(
            404,
            f"The model `{name}` does not exist (this server runs `{engine.model_name}`).",
            param="model",
            code="model_not_found",
        )


def _batch(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """One prompt (text or token ids) or a batch of them, as a list of prompts."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return list(prompt)  # type: ignore[arg-type]


async def _prompt_ids(engine: Engine, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        # Valid Unicode, at most max_prompt_bytes, and tokenized off the loop when big.
        return await engine.encode_text(prompt)
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return prompt  # the engine checks each id against the vocabulary


def _max_tokens(
    engine: Engine, prompt_len: int, asked: int | None, what: str, *, param: str = "max_tokens"
) -> int:
    """`asked` if prompt and completion fit the context, else a 400 naming both numbers;
    unset, the default (what fits, for chat; 16 or what fits, for completions)."""
    limit = engine.max_model_len
    if prompt_len >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens; "
            f"the {what} has {prompt_len} tokens, leaving none for the completion.",
            param=what,
        )
    if asked is None:
        room = limit - prompt_len
        return min(room, COMPLETION_MAX_TOKENS) if what == "prompt" else room
    if prompt_len + asked > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + asked} tokens ({prompt_len} in the {what}, {asked} for the "
            f"completion). Please reduce the length of the {what} or of {param}.",
            param=param,
        )
    return asked


async def _sampling(engine: Engine, body: OpenAISampling, max_tokens: int) -> dict[str, Any]:
    """The body's `SamplingParams` kwargs, checked here so a bad one names its field. A
    grammar compiles in a worker thread (a large schema can take a while), into the
    cache the engine then reads."""
    kwargs = body.sampling(max_tokens)
    try:
        params = SamplingParams(**kwargs)
        params.check_vocab(engine.loaded.config.vocab_size)
        if params.guided:
            await anyio.to_thread.run_sync(engine.guides.check, params)
    except ValueError as exc:
        param = field_of(exc)
        if param == "guided_json" and body.response_format is not None:
            param = "response_format"  # what the client sent
        raise ApiError(400, str(exc), param=param) from None
    return kwargs


# -- running and answering ---------------------------------------------------------------


async def _start(
    ctx: ServerContext, plans: list[tuple[list[int], int]], body: OpenAISampling
) -> list[Job]:
    """Each prompt's `n` samples as one family (sample 0 the parent, the rest its
    children; the engine gives sample i the seed + i), in choice order."""
    jobs: list[Job] = []
    checked = [await _sampling(ctx.engine, body, max_tokens) for _ids, max_tokens in plans]
    try:
        for (ids, _max), sampling in zip(plans, checked, strict=True):
            jobs += await ctx.engine.submit_samples(
                ids, n=body.n, priority=body.priority, owner=current_owner(), **sampling
            )
    except BaseException:
        _cancel_all(ctx, jobs, "disconnect")
        raise
    return jobs


def _cancel_all(ctx: ServerContext, jobs: list[Job], reason: str) -> None:
    for job in reversed(jobs):  # children first, so each records this reason itself
        ctx.engine.cancel_nowait(job.id, reason=reason)


async def _complete(
    ctx: ServerContext,
    plans: list[tuple[list[int], int]],
    body: OpenAISampling,
    *,
    chat: bool,
    echo: list[str] | None = None,
) -> Any:
    jobs = await _start(ctx, plans, body)
    view = _Choices(ctx.engine, body, chat=chat, echo=echo)
    if body.stream:
        chunks = _chunks(ctx, jobs, body, view)
        ids = [job.id for job in reversed(jobs)]
        return sse_response(StreamBody(ctx, chunks, cancel_ids=ids), jobs[0].id)
    try:
        results = [await job.wait() for job in jobs]
    finally:
        if not all(job.done for job in jobs):
            _cancel_all(ctx, jobs, disconnect_reason())
    choices = []
    for index, result in enumerate(results):
        choice: dict[str, Any] = {"index": index, "finish_reason": result.finish_reason}
        text = view.prefix(index) + result.text
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = view.logprobs(result.token_ids, result.logprobs, index)
        choices.append(choice)
    prompt_tokens = sum(len(ids) for ids, _ in plans)
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


class _Choices:
    """How a choice's text and log-probabilities are shown, in OpenAI's formats."""

    def __init__(
        self, engine: Engine, body: OpenAISampling, *, chat: bool, echo: list[str] | None
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.n = body.n
        self.echo = echo
        self.wanted = body.logprobs_wanted is not None

    def prefix(self, index: int) -> str:
        """The echoed prompt of choice `index` (completions with `echo`)."""
        return self.echo[index // self.n] if self.echo is not None else ""

    def token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token], skip_special_tokens=False)

    def logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        index: int,
        offset: int = 0,
    ) -> dict[str, Any] | None:
        if not self.wanted or logprobs is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        **self._entry(t, lp.logprob),
                        "top_logprobs": [self._entry(*x) for x in lp.top],
                    }
                    for t, lp in zip(token_ids, logprobs, strict=True)
                ],
                "refusal": None,
            }
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        at = offset or len(self.prefix(index))
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [self._top(lp) for lp in logprobs],
            "text_offset": offsets,
        }

    def _top(self, logprobs: TokenLogprobs) -> dict[str, float]:
        """Completions' `{token text: logprob}`; two tokens that decode alike (parts of
        one character) would collide, so the later one is keyed `token_id:N` (vLLM's
        spelling of a token by id)."""
        top: dict[str, float] = {}
        for token, value in logprobs.top:
            text = self.token_text(token)
            top[text if text not in top else f"token_id:{token}"] = value
        return top

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


async def _chunks(
    ctx: ServerContext, jobs: list[Job], body: OpenAISampling, view: _Choices
) -> AsyncGenerator[dict[str, Any] | str, None]:
    """The SSE chunks of the samples as they arrive, the usage chunk if asked, `[DONE]`."""
    chat = view.chat
    request_id, created, model = jobs[0].id, int(time.time()), ctx.engine.model_name
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(
        index: int,
        text: str | None,
        finish_reason: str | None,
        *,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
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
    offsets = [len(view.prefix(i)) for i in range(len(jobs))]
    for index in range(len(jobs)):
        if chat:
            yield chunk(index, "", None, role=True)
        elif view.prefix(index):
            yield chunk(index, view.prefix(index), None)
    async for index, delta in merge_streams(jobs):  # the samples interleaved, as they come
        if delta is None:
            result = jobs[index].result
            completion_tokens += result.completion_tokens
            yield chunk(index, None if chat else "", result.finish_reason)
        elif delta.text or (view.wanted and delta.logprobs):
            logprobs = view.logprobs(delta.token_ids, delta.logprobs, index, offsets[index])
            offsets[index] += sum(len(view.token_text(t)) for t in delta.token_ids)
            yield chunk(index, delta.text, None, logprobs=logprobs)
    if body.include_usage:
        prompt_tokens = sum(jobs[i].result.prompt_tokens for i in range(0, len(jobs), body.n))
        yield {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [],
            "usage": _usage(prompt_tokens, completion_tokens),
        }
    yield "[DONE]"
