"""OpenAI's Responses API: `POST /v1/responses`, and `GET`, `DELETE` and
`POST .../cancel` of a stored one, and its `input_items`.

A response is one request of the engine, its prompt the model's chat template over
the input (`schemas.conversation`, after the conversation of
`previous_response_id` and a system message of `instructions`). It is answered whole,
streamed (`format.ResponseEvents`; closing the stream cancels the request)
or, with `background`, at once with its status `queued` or `in_progress`: then `GET`
shows how it stands and `POST /v1/responses/{id}/cancel` cancels it. `DELETE
/v1/responses/{id}` forgets a stored response and cancels its request if it still
runs. The engine's request id is the `X-Request-Id` header, so `DELETE
/requests/{id}` cancels any response, background or not.

With `truncation: auto`, the oldest turns of a conversation too long are dropped (a
turn with what answered it) until it is within `max_prompt_bytes` and the answer has
room in the context.

A background response may be streamed too; closing that stream cancels nothing, and
`GET /v1/responses/{id}?stream=true&starting_after=N` streams it again, from event
N + 1, while it runs.

Refused with a 400 naming the field: an empty `input`, `background` without `store`, a
`text.format` beside a required or named `tool_choice`, a `json_schema` format
without its schema, a `stream` query on `GET` of a response not made in the
background or that has ended, a cancel of a response not made in the background. A
`previous_response_id` that is not stored (or is another key's) is a 404, one still
running a 400.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from quart import Blueprint, current_app, request
from quart.blueprints import BlueprintSetupState
from quart_schema import document_request

from kvscope import InvalidRequest, Job
from kvscope.params import TO_THE_CONTEXT_END, ContextPolicy

from ...auth import current_owner
from ...context import ServerContext, disconnect_reason, server
from ...errors import ApiError
from ...parsers.reasoning import NONE as NO_REASONING
from ...parsers.reasoning import ReasoningParser
from ...sse import StreamBody, sse_response
from ..chat import chat_prompt, chat_size
from ..chat_schemas import ChatMessage, ChatTemplateOptions
from ..completions import read_openai_body
from ..model_names import adapter_of
from ..run import body_names, refused
from ..tools import ToolPlan
from .format import ResponseEvents
from .ids import response_id
from .schemas import ResponsesBody, conversation, input_items, listed_items
from .store import ResponseStore, StoredResponse
from .view import ResponseView

blueprint = Blueprint("responses", __name__, url_prefix="/v1")

#: Where the app keeps its `ResponseStore`.
STORE = "kvscope.responses"


@blueprint.record_once
def _open_store(state: BlueprintSetupState) -> None:
    settings = state.app.extensions["kvscope"].settings
    state.app.extensions[STORE] = ResponseStore(
        settings.stored_responses, settings.stored_responses_bytes, settings.api_keys
    )


def _store() -> ResponseStore:
    return current_app.extensions[STORE]  # type: ignore[no-any-return]


@blueprint.post("/responses")
@document_request(ResponsesBody)
async def create_response() -> Any:
    """A response to `input` (text or items): whole, streamed, or in the background."""
    ctx = server()
    body = await read_openai_body(ResponsesBody)
    _check(ctx, body)
    owner = current_owner()
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = _store().get(body.previous_response_id, owner, param="previous_response_id")
        history = previous.conversation()
    items = input_items(body.input)
    messages = history + conversation(items)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    plan = body.tool_plan.reading(ctx.tool_parser)
    if body.truncation == "auto":  # the oldest turns go while the chat is too big
        while len(messages) > 1 and _size(system + messages) > ctx.engine.max_prompt_bytes:
            messages = _without_oldest_turn(messages)
    prompt = await _rendered(ctx, system + messages, plan)
    if body.truncation == "auto":  # and until the answer has room
        room = body.max_output_tokens or 1
        while len(prompt) + room > ctx.engine.max_model_len and len(messages) > 1:
            messages = _without_oldest_turn(messages)
            prompt = await _rendered(ctx, system + messages, plan)
    job = await _submit(ctx, body, prompt, plan, owner)
    model = adapter_of(ctx.engine, body.model) or ctx.engine.model_name
    view = ResponseView(
        response_id(job.id),
        body,
        model,
        _shown(ctx, body),
        plan,
        tokenizer=ctx.engine.tokenizer,
        reasoning=_reasoning(ctx, body),
        as_ids=ctx.settings.return_tokens_as_token_ids,
    )
    entry = StoredResponse(view, owner, messages, listed_items(items, view.id), job)
    if body.store:
        _store().add(entry)
    headers = {"X-Request-Id": job.id}
    if body.stream:  # closing it cancels the request, unless it runs in the background
        cancel = [] if body.background else [job.id]
        return sse_response(StreamBody(ctx, _events(entry), cancel_ids=cancel), job.id)
    if body.background:
        return entry.current(), 200, headers
    try:
        await job.wait()
    finally:
        if not job.done:
            ctx.engine.cancel_nowait(job.id, reason=disconnect_reason())
    return entry.current(), 200, headers


async def _submit(
    ctx: ServerContext, body: ResponsesBody, prompt: list[int], plan: ToolPlan, owner: str | None
) -> Job:
    """The response's request. The client's `max_output_tokens` is refused where the
    input leaves it no room (OpenAI's 400); unset, the answer runs to the context's end
    (admission's rule). A refusal names the field as the body does."""
    asked = body.max_output_tokens
    context: ContextPolicy = "cap" if asked is None else "refuse"
    sampling = body.to_sampling_params(asked or TO_THE_CONTEXT_END)
    sampling |= {"lora": adapter_of(ctx.engine, body.model)} | plan.sampling_overrides()
    try:
        return await ctx.engine.submit(
            prompt, priority=body.priority, owner=owner, context=context, **sampling
        )
    except InvalidRequest as exc:
        schema_field = "text" if body.text_format.type != "text" else "tools"
        raise await refused(ctx.engine, exc, body_names(schema_field, body.ENGINE_NAMES)) from None


async def _rendered(
    ctx: ServerContext, messages: list[dict[str, Any]], plan: ToolPlan
) -> list[int]:
    """The prompt token ids of `messages`, as the chat route renders them."""
    return await chat_prompt(
        ctx.engine,
        [ChatMessage(**message) for message in messages],
        ChatTemplateOptions.model_validate({}),
        tools=plan.template_tools(),
    )


def _size(messages: list[dict[str, Any]]) -> int:
    return chat_size([ChatMessage(**message) for message in messages])


def _without_oldest_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` less the first, and less what answered it (assistant turns, tool
    outputs), so the conversation still opens with a user's (or a system) message."""
    rest = messages[1:]
    while len(rest) > 1 and rest[0]["role"] in ("assistant", "tool"):
        rest = rest[1:]
    return rest


def _check(ctx: ServerContext, body: ResponsesBody) -> None:
    if not body.input:
        raise ApiError(400, "the input is empty", param="input")
    if body.background and not body.store:
        # vLLM's words (its tests match them).
        raise ApiError(400, "background can only be used when `store` is true", param="background")
    if body.top_logprobs is not None and body.logprobs_wanted is None:
        raise ApiError(
            400,
            "top_logprobs needs include: [message.output_text.logprobs]",
            param="top_logprobs",
        )
    if body.logprobs_wanted is not None and body.tool_plan.calls_tools:
        # The text may become calls: no log-probabilities beside them, as on chat.
        raise ApiError(400, "the output text's logprobs are not given with tools", param="include")
    if body.logprobs_wanted is not None and _reasoning(ctx, body).splits:
        raise ApiError(
            400, "the output text's logprobs are not given with a reasoning parser", param="include"
        )
    fmt = body.text_format
    if fmt.type == "json_schema" and fmt.schema_ is None:
        raise ApiError(400, "a json_schema format needs schema", param="text.format.schema")
    if body.tool_plan.guide() is not None and fmt.type != "text":
        raise ApiError(
            400,
            "a required or named tool_choice constrains the output itself: give no "
            "text.format with it",
            param="tool_choice",
        )


def _reasoning(ctx: ServerContext, body: ResponsesBody) -> ReasoningParser:
    """The server's reasoning parser, unless the output is JSON (a schema's, a tool's
    arguments), which has no room for reasoning."""
    if body.text_format.type != "text" or body.tool_plan.guide() is not None:
        return NO_REASONING
    return ctx.reasoning


def _shown(ctx: ServerContext, body: ResponsesBody) -> dict[str, Any]:
    """The temperature and top_p it runs with: the body's, else the checkpoint's
    generation defaults, else kvscope's."""
    defaults = ctx.engine.loaded.generation_defaults
    return {
        name: getattr(body, name)
        if name in body.model_fields_set
        else defaults.get(name, getattr(body, name))
        for name in ("temperature", "top_p")
    }


async def _events(entry: StoredResponse, after: int = -1) -> AsyncGenerator[bytes, None]:
    events = ResponseEvents(entry.view, after=after)
    yield events.opening()
    first = True
    async for delta in entry.job:
        if not delta.token_ids:
            continue
        out = events.feed(delta.text, first, delta.token_ids, delta.logprobs)
        first = False
        if out:
            yield out
    closing = events.closing(entry.job.result)
    entry.answer = events.final
    yield closing


@blueprint.get("/responses/<response_id>")
async def get_response(response_id: str) -> Any:
    """A stored response as it stands; with `?stream=true`, a background response
    that still runs streams its events again, those after `starting_after` (closing
    that stream cancels nothing)."""
    entry = _store().get(response_id, current_owner())
    if request.args.get("stream", "false").lower() in ("false", "0"):
        return entry.current()
    if not entry.view.body.background:
        raise ApiError(400, "only a background response streams again", param="stream")
    if entry.job.done:
        raise ApiError(400, "the response has ended: GET it without stream", param="stream")
    after = request.args.get("starting_after", "-1")
    if not after.lstrip("-").isdigit():
        raise ApiError(
            400, f"starting_after must be a number, not {after!r}", param="starting_after"
        )
    return sse_response(StreamBody(server(), _events(entry, int(after))), entry.job.id)


#: `GET .../input_items`: the query it takes, and the most items a page holds.
PAGE_QUERY = frozenset({"after", "limit", "order"})
MAX_PAGE = 100


@blueprint.get("/responses/<response_id>/input_items")
async def list_input_items(response_id: str) -> Any:
    """A stored response's input items, a page at a time (`limit`, 20 unless set, up
    to 100; `order`, `desc` unless `asc`; `after` an item's id)."""
    entry = _store().get(response_id, current_owner())
    args = request.args
    unknown = sorted(set(args) - PAGE_QUERY)
    if unknown:
        raise ApiError(400, f"{unknown[0]} is not supported by this server", param=unknown[0])
    limit = args.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
        raise ApiError(400, f"limit must be 1-{MAX_PAGE}, not {limit!r}", param="limit")
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, not {order!r}", param="order")
    items = entry.items if order == "asc" else entry.items[::-1]
    if "after" in args:
        ids = [item["id"] for item in items]
        if args["after"] not in ids:
            raise ApiError(400, f"no input item {args['after']!r}", param="after")
        items = items[ids.index(args["after"]) + 1 :]
    page = items[: int(limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }


@blueprint.post("/responses/<response_id>/cancel")
async def cancel_response(response_id: str) -> Any:
    """Cancel a background response: its request ends and frees its blocks at once;
    the answer is the response, `cancelled` (or as it ended, if it already had)."""
    entry = _store().get(response_id, current_owner())
    if not entry.view.body.background:
        raise ApiError(
            400,
            "Cannot cancel a synchronous response: only a background response is cancelled "
            "here; DELETE /requests/{id} (its X-Request-Id) cancels any",
            param="response_id",
        )
    await _cancel(entry.job)
    return entry.current()


@blueprint.delete("/responses/<response_id>")
async def delete_response(response_id: str) -> Any:
    """Forget a stored response; one still running is cancelled."""
    store = _store()
    entry = store.get(response_id, current_owner())
    store.remove(response_id)
    await _cancel(entry.job)
    return {"id": response_id, "object": "response", "deleted": True}


async def _cancel(job: Job) -> None:
    if not job.done:
        await server().engine.cancel(job.id, reason="user", by=current_owner() or "api")
