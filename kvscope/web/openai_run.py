"""Running an OpenAI call: its samples as request families, answered whole or streamed.

Each prompt's `n` samples are one family: sample 0 the parent, the rest its children
(the engine gives sample i the seed + i), so they share the prompt's KV blocks and
cancelling the parent cancels them all. A whole answer waits for every sample; if the
client goes away meanwhile, the `finally` cancels them (reason `disconnect`). A stream
answers the chunks as the samples produce them, then the usage chunk if asked and
`[DONE]`; closing it cancels every sample (`StreamBody`).

The stream's per-token work is one template fill per delta (`ChunkFormat.text_chunk`)
and one write per wake-up: what is ready together (the opening chunks, the last finish
chunk with the usage and `[DONE]`) goes out as one body chunk.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import anyio

from kvscope import BeamSearchParams, Completion, Engine, Job, merge_streams
from kvscope.actors.beam_search import gather
from kvscope.params import GUIDES, SamplingParams, field_of

from .auth import current_owner
from .context import ServerContext, disconnect_reason
from .errors import ApiError
from .model_names import adapter_of
from .openai_format import Choices, ChunkFormat, usage
from .openai_schemas import OpenAISampling
from .reasoning import NONE as NO_REASONING
from .reasoning import ReasoningParser, ReasoningStream
from .sse import DONE, StreamBody, encode, sse_response
from .tool_parsers import CallStream
from .tools import ToolPlan

Plan = tuple[list[int], int]  # a prompt's token ids and its max_tokens


async def check_sampling(engine: Engine, body: OpenAISampling, max_tokens: int) -> dict[str, Any]:
    """The body's `SamplingParams` kwargs, checked here so a bad one names its field."""
    given = body.guide_fields  # what the client sent; else a tool call's schema
    kwargs = body.sampling(max_tokens) | {"lora": adapter_of(engine, body.model)}
    return await check_params(engine, kwargs, given[0] if given else "tools")


async def check_params(engine: Engine, kwargs: dict[str, Any], guide_field: str) -> dict[str, Any]:
    """`kwargs` once they make valid `SamplingParams` for `engine`'s model: else a 400
    naming the field (`guide_field` for the grammar, which the client sent under its
    own name). A grammar compiles in a worker thread (a large schema can take a while),
    into the cache the engine then reads."""
    try:
        params = SamplingParams(**kwargs)
        params.check_vocab(engine.loaded.config.vocab_size)
        if params.guided:
            await anyio.to_thread.run_sync(engine.guides.check, params)
    except ValueError as exc:
        param = field_of(exc)
        raise ApiError(400, str(exc), param=guide_field if param in GUIDES else param) from None
    return kwargs


async def start(
    ctx: ServerContext, plans: list[Plan], body: OpenAISampling, tools: ToolPlan | None = None
) -> list[Job]:
    """Each prompt's `n` samples as one family, in choice order."""
    jobs: list[Job] = []
    checked = [await check_sampling(ctx.engine, body, max_tokens) for _ids, max_tokens in plans]
    overrides = tools.sampling_overrides() if tools is not None else {}
    try:
        for (ids, _max), sampling in zip(plans, checked, strict=True):
            jobs += await ctx.engine.submit_samples(
                ids,
                n=body.n,
                priority=body.priority,
                owner=current_owner(),
                **(sampling | overrides),
            )
    except BaseException:
        cancel_all(ctx, jobs, "disconnect")
        raise
    return jobs


async def beam_search(
    ctx: ServerContext, plans: list[Plan], body: OpenAISampling
) -> list[Completion]:
    """Each prompt's `n` best beams, in choice order (the prompts searched at once).
    The searches run in this call's scope: a client that goes away cancels them."""
    if refusal := body.beam_search_refusal():
        raise ApiError(400, refusal[0], param=refusal[1])
    for _ids, max_tokens in plans:  # the sampling fields' own checks, as for a sample
        await check_sampling(ctx.engine, body, max_tokens)
    temperature = body.temperature if "temperature" in body.model_fields_set else 0.0

    def search(ids: list[int], max_tokens: int) -> Callable[[], Awaitable[list[Completion]]]:
        params = BeamSearchParams(
            beam_width=body.n,
            max_tokens=max_tokens,
            temperature=temperature,
            length_penalty=body.length_penalty,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            lora=adapter_of(ctx.engine, body.model),
            owner=current_owner(),
            priority=body.priority,
        )
        return functools.partial(ctx.engine.beam_search, ids, params)

    found = await gather([search(ids, max_tokens) for ids, max_tokens in plans])
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
    plans: list[Plan],
    body: OpenAISampling,
    *,
    chat: bool,
    tools: ToolPlan | None = None,
    reasoning: ReasoningParser = NO_REASONING,
) -> Any:
    """Run the call and answer it: an SSE stream with `stream`, else the whole response.
    A chat's `reasoning` parser tells its reasoning (`reasoning_content`) from its
    answer, the content, in which its tool calls are read."""
    view = Choices(ctx.engine, body, [ids for ids, _ in plans], chat=chat)
    model = adapter_of(ctx.engine, body.model) or ctx.engine.model_name
    if body.use_beam_search:
        results = await beam_search(ctx, plans, body)
    else:
        jobs = await start(ctx, plans, body, tools)
        if body.stream:
            fmt = ChunkFormat(jobs[0].id, int(time.time()), model, chat=chat)
            chunks = stream_chunks(jobs, body, view, fmt, tools, reasoning)
            ids = [job.id for job in reversed(jobs)]
            return sse_response(StreamBody(ctx, chunks, cancel_ids=ids), jobs[0].id)
        results = await wait_all(ctx, jobs)
    fmt = ChunkFormat(results[0].id, int(time.time()), model, chat=chat)
    choices = []
    for index, result in enumerate(results):
        choice: dict[str, Any] = {"index": index, "finish_reason": result.finish_reason}
        thought, said = reasoning.split(result.text)
        text = view.prefix(index) + (said or "")
        if tools is not None and tools.calls_tools:
            content, calls, choice["finish_reason"] = tools.answer(text, result.finish_reason)
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
        elif chat:
            shown = text if said is not None or view.prefix(index) else None
            choice["message"] = {"role": "assistant", "content": shown}
        else:
            choice["text"] = text
        if reasoning.splits:
            choice["message"]["reasoning_content"] = thought
        choice["logprobs"] = view.of_result(result, index)
        if body.prompt_logprobs is not None and not chat:
            choice["prompt_logprobs"] = view.vllm_prompt_logprobs(index, result.prompt_logprobs)
        choices.append(choice)
    prompt_tokens = sum(len(ids) for ids, _ in plans)
    completion_tokens = sum(r.completion_tokens for r in results)
    cached = sum(r.cached_tokens for r in results[:: body.n])  # each prompt's sample 0
    answer = {
        **fmt.head,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }
    if body.prompt_logprobs is not None and chat:  # vLLM's place for the one prompt's
        answer["prompt_logprobs"] = view.vllm_prompt_logprobs(0, results[0].prompt_logprobs)
    return answer, 200, {"X-Request-Id": results[0].id}


async def stream_chunks(
    jobs: list[Job],
    body: OpenAISampling,
    view: Choices,
    fmt: ChunkFormat,
    tools: ToolPlan | None = None,
    reasoning: ReasoningParser = NO_REASONING,
) -> AsyncGenerator[bytes, None]:
    """The SSE chunks of the samples as they arrive (interleaved, told apart by
    `index`), the usage chunk if asked, `[DONE]`. With vLLM's `continuous_usage_stats`
    every chunk carries its choice's usage so far. A named function's arguments go out
    as they come; under `auto` the content does up to where a call may begin, then each
    call's name and its arguments as they come (`CallStream`; a call it cannot stream,
    at the end); under `required`, all at the end.
    With a `reasoning` parser the reasoning goes out as `reasoning_content` deltas, and
    the answer as the content (the tools read from it)."""
    chat = view.chat
    thinking = {i: ReasoningStream(reasoning) for i in range(len(jobs))} if reasoning.splits else {}
    whole = tools if tools is not None and tools.calls_tools else None
    auto = whole is not None and whole.mode == "auto"
    held = {i: whole.held_content() for i in range(len(jobs))} if whole and auto else {}
    single = whole is not None and whole.single
    calls_of = {i: CallStream(h, single=single) for i, h in held.items()}
    streamed = [0] * len(jobs)  # the tokens each choice has streamed so far
    prompt_lengths = [len(view.prompts[i // body.n]) for i in range(len(jobs))]

    def framed(index: int, chunk: dict[str, Any]) -> bytes:
        if body.continuous_usage:
            chunk["usage"] = usage(prompt_lengths[index], streamed[index])
        return encode(chunk)

    # An echo scored with `logprobs` waits for its prompt's log-probabilities, which
    # come with the sample's first token (or its end).
    echo_later = set(range(len(jobs))) if view.scores_echo else set()
    opening = [
        framed(i, fmt.chunk(i, view.prefix(i), None, role=chat))
        for i in range(len(jobs))
        if (chat or view.prefix(i)) and i not in echo_later
    ]
    if opening:
        yield b"".join(opening)
    completion_tokens, left, last = 0, len(jobs), b""
    offsets = [len(view.prefix(i)) for i in range(len(jobs))]
    async for index, delta in merge_streams(jobs):
        if index in echo_later and (delta is None or delta.token_ids):
            echo_later.discard(index)
            scored = jobs[index].result.prompt_logprobs if delta is None else delta.prompt_logprobs
            logprobs = view.prompt_logprobs(index, scored)
            yield framed(index, fmt.chunk(index, view.prefix(index), None, logprobs=logprobs))
        if delta is None:
            result = jobs[index].result
            completion_tokens += result.completion_tokens
            streamed[index] = result.completion_tokens
            left -= 1
            reason = result.finish_reason
            answer = result.text
            if thinking:  # what the stream held back, and the answer whole
                thought, rest = thinking[index].finish()
                if thought:
                    yield framed(index, fmt.chunk(index, None, None, reasoning=thought))
                if rest and not whole:
                    yield framed(index, fmt.chunk(index, rest, None))
                answer = reasoning.split(answer)[1] or ""
            if whole and whole.streams_arguments:
                if not streamed[index]:  # no token came: the call is named all the same
                    calls = whole.argument_deltas("", first=True)
                    yield framed(index, fmt.chunk(index, None, None, tool_calls=calls))
            elif whole:
                content, calls, reason = whole.answer(answer, reason)
                if index in held:  # `auto`: what was not sent yet, of the content and calls
                    stream = calls_of[index]
                    content = None if stream.opened else held[index].rest(answer) or None
                    calls = stream.rest(calls)
                if content or calls:
                    yield framed(index, fmt.chunk(index, content, None, tool_calls=calls))
            finish = framed(index, fmt.chunk(index, None if chat else "", reason))
            if left:
                yield finish
            else:  # the last one goes out with the usage and [DONE], in one write
                last = finish
            continue
        first = not streamed[index]
        streamed[index] += len(delta.token_ids)
        text = delta.text
        if thinking:
            thought, text = thinking[index].feed(text)
            if thought:
                yield framed(index, fmt.chunk(index, None, None, reasoning=thought))
        if whole and whole.streams_arguments and (text or first):
            calls = whole.argument_deltas(text, first)
            yield framed(index, fmt.chunk(index, None, None, tool_calls=calls))
        elif index in held:
            if piece := held[index].feed(text):
                yield framed(index, fmt.chunk(index, piece, None))
            if calls := calls_of[index].advance():
                yield framed(index, fmt.chunk(index, None, None, tool_calls=calls))
        if whole:
            continue  # sent as arguments or content up to a call, the rest at its end
        if view.wanted and (text or delta.logprobs):
            logprobs = view.logprobs(delta.token_ids, delta.logprobs, index, offsets[index])
            offsets[index] += sum(len(view.token_text(t)) for t in delta.token_ids)
            yield framed(index, fmt.chunk(index, text, None, logprobs=logprobs))
        elif text and body.continuous_usage:
            yield framed(index, fmt.chunk(index, text, None))
        elif text:
            yield fmt.text_chunk(index, text)
    if body.include_usage:
        prompts = sum(jobs[i].result.prompt_tokens for i in range(0, len(jobs), body.n))
        cached = sum(jobs[i].result.cached_tokens for i in range(0, len(jobs), body.n))
        last += encode(fmt.usage_chunk(prompts, completion_tokens, cached))
    yield last + DONE
