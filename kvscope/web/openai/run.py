"""Running an OpenAI call: its samples as request families, answered whole or streamed.

Each prompt's `n` samples are one family: sample 0 the parent, the rest its children
(the engine gives sample i the seed + i), so they share the prompt's KV blocks and
cancelling the parent cancels them all. A whole answer waits for every sample; if the
client goes away meanwhile, the `finally` cancels them (reason `disconnect`). A stream
(`stream`) answers the chunks as the samples produce them, then the usage chunk
if asked and `[DONE]`; closing it cancels every sample (`StreamBody`).

A sampling field the engine refuses (its `InvalidRequest` carries the field) is a 400
naming it as the body does (`refused`); a `logit_bias` with bad entries names each of
them (as vLLM's does), each checked by `SamplingParams`' own rule.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvscope import BeamSearchParams, Completion, Engine, InvalidRequest, Job
from kvscope.beam_search import beam_search as search_beams
from kvscope.beam_search import gather
from kvscope.params import GUIDES, SamplingParams

from ..auth import current_owner
from ..context import ServerContext, disconnect_reason
from ..errors import ApiError, from_engine
from ..parsers.reasoning import NONE as NO_REASONING
from ..parsers.reasoning import ReasoningParser
from ..sse import StreamBody, sse_response
from .format import WHOLE_ANSWER_NULLS, Choices, ChunkFormat, usage_of
from .model_names import adapter_of
from .schemas import OpenAISampling
from .stream import StreamSetup, stream_chunks
from .tools import ToolPlan


def body_names(guide_field: str, names: Mapping[str, str] = {}) -> dict[str, str]:
    """The body's names of the engine's fields where they differ: every guide is
    `guide_field` (the field the client constrained the output with, under its own
    name), the adapter is the `model` that named it, and `names` the others."""
    return {**dict.fromkeys(GUIDES, guide_field), "lora": "model", **names}


def sampling_names(body: OpenAISampling) -> dict[str, str]:
    given = body.guide_fields  # what the client sent; else a tool call's schema
    return body_names(given[0] if given else "tools", body.engine_names())


async def refused(
    engine: Engine, exc: InvalidRequest, names: Mapping[str, str], bias: object = None
) -> ApiError:
    """The 400 for the engine's refusal of a call: its field as the body names it
    (`names`, engine -> body). A refused `logit_bias` (the body's `bias`) names each of
    its bad entries, checked off the event loop when there are many."""
    message = None
    if exc.field == "logit_bias" and isinstance(bias, Mapping):
        work = functools.partial(logit_bias_errors, bias, engine.loaded.config.vocab_size)
        message = await engine.run_off_loop(len(bias) * BIAS_ENTRY_BYTES, work) or None
    return from_engine(exc, names=names, message=message)


#: About the bytes of one `logit_bias` entry: its share of a body (so a large one is
#: checked entry by entry off the event loop).
BIAS_ENTRY_BYTES = 16
#: The most bad `logit_bias` entries an error names one by one.
MAX_NAMED_ENTRIES = 16


def logit_bias_errors(bias: Mapping[Any, Any], vocab_size: int) -> str:
    """What is wrong with each bad entry of `bias` (each checked alone by
    `SamplingParams`' rule and against the vocabulary), the first `MAX_NAMED_ENTRIES`
    named, in one message."""
    errors = []
    for key, value in bias.items():
        try:
            SamplingParams(logit_bias={key: value}).check_vocab(vocab_size)
        except ValueError as exc:
            errors.append(str(exc))
    named = "; ".join(errors[:MAX_NAMED_ENTRIES])
    more = len(errors) - MAX_NAMED_ENTRIES
    return f"{named}; and {more} more bad logit_bias entries" if more > 0 else named


async def start(
    ctx: ServerContext,
    prompts: list[list[int]],
    body: OpenAISampling,
    tools: ToolPlan | None = None,
) -> list[Job]:
    """Each prompt's `n` samples as one family, in choice order; a 400 naming the
    field (as the body does) if the engine refuses one, a prompt and `max_tokens` that
    overflow the context included (`body.limit`)."""
    jobs: list[Job] = []
    max_tokens, context = body.limit
    sampling = body.to_sampling_params(max_tokens) | {"lora": adapter_of(ctx.engine, body.model)}
    overrides = tools.sampling_overrides() if tools is not None else {}
    try:
        for ids in prompts:  # every prompt's context checked before any starts
            ctx.engine.fit(len(ids), max_tokens, context)
        for ids in prompts:
            jobs += await ctx.engine.submit_samples(
                ids,
                n=body.n,
                priority=body.priority,
                owner=current_owner(),
                context=context,
                **(sampling | overrides),
            )
    except BaseException as exc:
        cancel_all(ctx, jobs, "disconnect")
        if isinstance(exc, InvalidRequest):
            names = sampling_names(body)
            raise await refused(ctx.engine, exc, names, body.logit_bias) from None
        raise
    return jobs


async def beam_search(
    ctx: ServerContext, prompts: list[list[int]], body: OpenAISampling
) -> list[Completion]:
    """Each prompt's `n` best beams, in choice order (the prompts searched at once).
    The searches run in this call's scope: a client that goes away cancels them."""
    if refusal := body.beam_search_refusal():
        raise ApiError(400, refusal[0], param=refusal[1])
    temperature = body.temperature if "temperature" in body.model_fields_set else 0.0
    max_tokens, context = body.limit

    def search(ids: list[int]) -> Callable[[], Awaitable[list[Completion]]]:
        params = BeamSearchParams(
            beam_width=body.n,
            max_tokens=max_tokens,
            context=context,
            temperature=temperature,
            length_penalty=body.length_penalty,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            lora=adapter_of(ctx.engine, body.model),
            owner=current_owner(),
            priority=body.priority,
        )
        return functools.partial(search_beams, ctx.engine, ids, params)

    try:
        found = await gather([search(ids) for ids in prompts])
    except InvalidRequest as exc:
        raise await refused(ctx.engine, exc, sampling_names(body)) from None
    return [beam for beams in found for beam in beams]


async def wait_all(ctx: ServerContext, jobs: list[Job]) -> list[Completion]:
    """The jobs' completions; a client that goes away meanwhile cancels them."""
    try:
        return [await job.wait() for job in jobs]
    finally:
        if not all(job.done for job in jobs):
            cancel_all(ctx, jobs, disconnect_reason())


def cancel_all(ctx: ServerContext, jobs: list[Job], reason: str) -> None:
    for job in reversed(jobs):  # children first, so each records this reason itself
        ctx.engine.cancel_nowait(job.id, reason=reason)


async def complete(
    ctx: ServerContext,
    prompts: list[list[int]],
    body: OpenAISampling,
    *,
    chat: bool,
    tools: ToolPlan | None = None,
    reasoning: ReasoningParser = NO_REASONING,
) -> Any:
    """Run the call and answer it: an SSE stream with `stream` (`stream`), else
    the whole response. A chat's `reasoning` parser tells its reasoning
    (`reasoning_content`) from its answer, the content, in which its tool calls are
    read."""
    as_ids = ctx.settings.return_tokens_as_token_ids
    view = Choices(ctx.engine, body, prompts, chat=chat, as_ids=as_ids)
    model = adapter_of(ctx.engine, body.model) or ctx.engine.model_name
    details = ctx.settings.prompt_tokens_details
    if body.use_beam_search:
        results = await beam_search(ctx, prompts, body)
    else:
        jobs = await start(ctx, prompts, body, tools)
        if body.stream:
            fmt = ChunkFormat(jobs[0].id, int(time.time()), model, chat=chat)
            force = ctx.settings.force_include_usage
            setup = StreamSetup(
                body, view, fmt, tools, reasoning, details=details, force_usage=force
            )
            chunks = stream_chunks(jobs, setup)
            ids = [job.id for job in reversed(jobs)]
            return sse_response(StreamBody(ctx, chunks, cancel_ids=ids), jobs[0].id)
        results = await wait_all(ctx, jobs)
    fmt = ChunkFormat(results[0].id, int(time.time()), model, chat=chat)
    choices = [
        _choice(index, result, view, tools, reasoning) for index, result in enumerate(results)
    ]
    answer = {
        **fmt.head,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        **WHOLE_ANSWER_NULLS,
        "usage": usage_of(results, body.n, details=details),
    }
    if chat:  # vLLM's place for the one prompt's: the answer's, null unless asked
        answer["prompt_logprobs"] = view.vllm_prompt_logprobs(0, results[0].prompt_logprobs)
        # The one prompt's; a batch of chats has no one prompt (vLLM's: null).
        answer["prompt_token_ids"] = view.returned_ids(0, ())[0] if len(prompts) == 1 else None
    return answer, 200, {"X-Request-Id": results[0].id}


def _choice(
    index: int,
    result: Completion,
    view: Choices,
    tools: ToolPlan | None,
    reasoning: ReasoningParser,
) -> dict[str, Any]:
    """Choice `index` of a whole answer, from its sample's `result`."""
    choice: dict[str, Any] = {"index": index, "finish_reason": result.finish_reason}
    thought, said = reasoning.split(result.text)
    text = view.prefix(index) + (said or "")
    if tools is not None and tools.calls_tools:
        content, calls, choice["finish_reason"] = tools.answer(text, result.finish_reason)
        choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
    elif view.chat:
        shown = text if said is not None or view.prefix(index) else None
        choice["message"] = {"role": "assistant", "content": shown}
    else:
        choice["text"] = text
    if reasoning.splits:
        choice["message"]["reasoning_content"] = thought
    choice["logprobs"] = view.of_result(result, index)
    prompt_ids, choice["token_ids"] = view.returned_ids(index, result.token_ids)
    if not view.chat:  # vLLM's, on each completions choice: null unless asked
        choice["prompt_logprobs"] = view.vllm_prompt_logprobs(index, result.prompt_logprobs)
        choice["prompt_token_ids"] = prompt_ids
    return choice
