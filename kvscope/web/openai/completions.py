"""The OpenAI-compatible API: `/v1/completions`, `/v1/chat/completions` (and vLLM's
`/v1/chat/completions/batch`), `/v1/models`.

This module reads and checks a call's body and hands it on: the prompts become token
ids in `prompts`, `run` runs the samples and answers (whole or streamed),
`format` shows them in OpenAI's formats. The `n` samples of one prompt are one
parent request (sample 0) and `n - 1` children, so cancelling the parent cancels them
all. A batch of prompts on `/v1/completions` is one such family per prompt (choice
`i * n + j` is prompt i's sample j), and so is a batch of chats (choice i). Closing a stream, or leaving before a whole answer,
cancels every sample of every prompt. The response `id` is the engine's id of the first
prompt's sample 0: `DELETE /requests/{id}` cancels that family.

What a body asks is honoured or refused with a 400 naming the field (`param`), never
ignored: unknown fields, a model this server does not run (404), `max_tokens` beyond
the context (the engine refuses it: the call's context policy is "refuse" where the
client gave `max_tokens`, see `OpenAISampling.limit`), a non-JSON `Content-Type`, `stream_options` without `stream`,
`prompt_logprobs` with `stream` (as vLLM), `best_of`, `tools` with a stream's
`logprobs`. `echo` with `logprobs` scores the prompt too (its log-probabilities come
first, the first token's null, as vLLM's do). Tool calls are `tools.py`'s. Errors are
in OpenAI's shape (see `errors`); a body its schema refuses is told in vLLM's words,
pydantic's errors and their types (`invalid_body`).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from quart import Blueprint, request
from quart_schema import document_request

from ..bodies import decode_json, validate
from ..context import ServerContext, server
from ..errors import ApiError
from ..parsers.reasoning import NONE as NO_REASONING
from .chat import chat_prompt
from .chat_schemas import BatchChatBody, ChatBody
from .model_names import adapter_of, check_model
from .prompts import check_batch, completion_prompts, prompt_ids, truncated
from .run import complete
from .schemas import CompletionBody, OpenAISampling
from .tools import ToolPlan

blueprint = Blueprint("openai", __name__, url_prefix="/v1")

B = TypeVar("B", bound=OpenAISampling)
M = TypeVar("M", bound=BaseModel)


def _model_card(ctx: ServerContext, model_id: str) -> dict[str, Any]:
    """The model's card, its `root` the model as `kvscope serve` was given it (vLLM's:
    its path, whatever name it is served as); or a LoRA adapter's: its `parent` the
    model, its `root` its directory (vLLM's)."""
    engine = ctx.engine
    adapter = adapter_of(engine, model_id)
    model_root = ctx.settings.model_path or engine.model_name
    return {
        "id": model_id,
        "object": "model",
        "created": ctx.started,
        "owned_by": "kvscope",
        "max_model_len": engine.max_model_len,
        "root": engine.adapters[adapter] if adapter else model_root,
        "parent": engine.model_name if adapter else None,
    }


@blueprint.get("/models")
async def list_models() -> Any:
    """The model this server runs, then its LoRA adapters."""
    ctx = server()
    names = [ctx.engine.model_name, *ctx.engine.adapters]
    return {"object": "list", "data": [_model_card(ctx, name) for name in names]}


@blueprint.get("/models/<path:model_id>")
async def get_model(model_id: str) -> Any:
    """The model (or LoRA adapter) `model_id`, if this server runs it (404 otherwise)."""
    ctx = server()
    check_model(ctx.engine, model_id)
    return _model_card(ctx, model_id)


@blueprint.post("/completions")
@document_request(CompletionBody)
async def completions() -> Any:
    """OpenAI text completions: one prompt or a batch, `n`, `stream`, `echo`, `logprobs`,
    the penalties, `logit_bias`, `seed`, `stop`, with usage counts."""
    ctx = server()
    body = await _read(CompletionBody)
    if body.best_of not in (None, 1):
        raise ApiError(400, "best_of is not supported (use n)", param="best_of")
    special = body.add_special_tokens
    prompts = [
        truncated(await prompt_ids(ctx.engine, p, add_special_tokens=special), body)
        for p in completion_prompts(body)
    ]
    return await complete(ctx, prompts, body, chat=False)


@blueprint.post("/chat/completions")
@document_request(ChatBody)
async def chat_completions() -> Any:
    """OpenAI chat completions; the prompt is the model's chat template over `messages`.
    Honours `n`, `stream`, `logprobs` / `top_logprobs`, the penalties, `logit_bias`,
    `seed`, `stop`, `response_format` (`json_object`, `json_schema`: constrained
    decoding), `tools` with `tool_choice` (`tools.py`) and vLLM's `echo` (the answer
    begins with the last message, when it is the assistant's)."""
    ctx = server()
    body = await _read(ChatBody)
    prompt, tools = await _chat_plan(ctx, body)
    # JSON (a schema's, a tool's arguments) has no room for reasoning: all of it is the
    # answer. A regex or a choice constrains the whole text, tags and all.
    json_out = body.json_output or tools.guide() is not None
    reasoning = NO_REASONING if json_out else ctx.reasoning
    return await complete(ctx, [prompt], body, chat=True, tools=tools, reasoning=reasoning)


@blueprint.post("/chat/completions/batch")
@document_request(BatchChatBody)
async def chat_completions_batch() -> Any:
    """vLLM's batch of chats: `messages` is a list of conversations, each answered as a
    chat of its own by the choice of its index; one answer, usage summed. Not streamed,
    no tools, no beam search, `n` 1 (vLLM's limits)."""
    ctx = server()
    body = await _read(BatchChatBody)
    body.check_batch()
    check_batch(len(body.messages), "messages")
    prompts = [(await _chat_plan(ctx, body.conversation(i)))[0] for i in range(len(body.messages))]
    reasoning = NO_REASONING if body.json_output else ctx.reasoning
    return await complete(ctx, prompts, body, chat=True, reasoning=reasoning)


async def _chat_plan(ctx: ServerContext, body: ChatBody) -> tuple[list[int], ToolPlan]:
    """A chat body's prompt, and what its tools ask, once its fields agree (a 400
    naming the one that does not)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    tools = body.tool_plan.reading(ctx.tool_parser)  # a 400 where tools and tool_choice disagree
    if tools.guide() is not None and body.guide_fields:
        raise ApiError(
            400,
            "a required or named tool_choice constrains the output itself: give no "
            f"{body.guide_fields[0]} with it",
            param="tool_choice",
        )
    if tools.calls_tools and body.echo:
        raise ApiError(400, "echo is not given with tools", param="echo")
    if tools.calls_tools and body.stream and body.logprobs:
        # A stream's choice that may call a tool sends its text as content up to a call
        # or as arguments, and the calls at its end; no log-probabilities beside them.
        raise ApiError(400, "logprobs with tools is not streamed", param="logprobs")
    prompt = body.forwarded_prompt(ctx.engine.loaded.config.vocab_size)
    if prompt is None:
        prompt = await chat_prompt(ctx.engine, body.messages, body, tools=tools.template_tools())
    return truncated(prompt, body), tools


# -- reading and checking a body ---------------------------------------------------------


async def read_openai_body(model: type[M]) -> M:
    """The body as `model`: JSON only, every field known, the model (`model`) this
    server's."""
    mimetype = request.mimetype
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise ApiError(400, f"Content-Type must be application/json, not {mimetype or 'none'!r}")
    data = decode_json(await request.get_data())
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(model.model_fields))
        if unknown:
            raise ApiError(400, f"{unknown[0]} is not supported by this server", param=unknown[0])
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise invalid_body(exc) from None
    except RecursionError:
        body = validate(model, data)  # its 400 for a body nested too deeply
    check_model(server().engine, getattr(body, "model", None))
    return body


def invalid_body(exc: ValidationError) -> ApiError:
    """The 400 of a body its model refuses, in vLLM's words: how many errors, each of
    pydantic's (its `type`, such as `greater_than_equal`, its `loc` under `body`, `msg`,
    `input`, `ctx`), then their list; `param` the first one's field."""
    found = exc.errors(include_url=False)
    errors = [{**error, "loc": ("body", *error["loc"])} for error in found]
    count = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:"
    listed = "".join(f"\n  {error}" for error in errors)
    where = ".".join(str(part) for part in found[0]["loc"]) if found else ""
    return ApiError(400, f"{count}{listed} {errors}", param=where or None)


async def _read(model: type[B]) -> B:
    """A completions or chat body, its sampling fields' rules checked."""
    body = await read_openai_body(model)
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise ApiError(
            400, "a json_schema response_format needs json_schema", param="response_format"
        )
    guides = body.guide_fields
    if len(guides) > 1:
        raise ApiError(400, f"give {guides[0]} or {guides[1]}, not both", param=guides[1])
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:
        # vLLM's rule too; `echo` with `logprobs` streams the prompt's scores instead.
        raise ApiError(400, "prompt_logprobs is not streamed", param="prompt_logprobs")
    return body
