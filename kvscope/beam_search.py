"""Beam search, as vLLM serves it (`use_beam_search`, `LLM.beam_search`): a client of
the Engine API, as `merge_streams` is, above the engine (it calls `Engine.generate`).

Like vLLM's, the search is built on requests of one token each: every step runs each
live beam (the prompt and the beam's tokens so far) as a request of `max_tokens=1` with
the `2 * beam_width` most likely next tokens' log-probabilities, all beams of a step at
once, so they share the step's batch and the prefix cache (each beam's prompt is
found computed up to its last full block). A candidate whose token ends the text (an
EOS of the model) is a finished beam; the `beam_width` best of the rest go on. At the
end the finished and the live beams are ranked by `cumulative log-probability /
length ** length_penalty` (the length counts the prompt, and not a final EOS), as
vLLM ranks them. Log-probabilities are the model's raw ones; a temperature above 0
only adds the token drawn at it to a step's candidates, as in vLLM.

Ending it: the search runs in its caller's scope, so a caller that leaves (a closed
connection, a cancelled task) cancels the step's requests, which free their blocks as
any request does. A step's requests are requests like any other: listed, and a
`DELETE` of one ends the search with the beams found so far (finish reason
`cancelled`, vLLM's `abort`). A request that fails fails the search.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import attrs

from kvscope.actors.messages import Completion
from kvscope.actors.spec import Prompt
from kvscope.errors import InvalidRequest
from kvscope.params import MAX_LOGPROBS, ContextPolicy

if TYPE_CHECKING:
    from kvscope.actors.engine import Engine

T = TypeVar("T")

#: The widest search: each step asks for 2 * width log-probabilities.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@attrs.frozen(kw_only=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, and the request options a step's requests take."""

    beam_width: int
    max_tokens: int
    temperature: float = 0.0
    length_penalty: float = 1.0
    ignore_eos: bool = False
    #: Keep a finished beam's EOS in its `token_ids` (never in its text).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    lora: str | None = None
    owner: str | None = None
    priority: int = 0
    #: A prompt and `max_tokens` that overflow the context: refused, or the search
    #: capped to the context's end (a request's `ContextPolicy`).
    context: ContextPolicy = "refuse"

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequest(
                f"beam search takes a beam width (n) of 1 to {MAX_BEAM_WIDTH}", field="n"
            )
        if self.max_tokens < 1:
            raise InvalidRequest("beam search needs max_tokens of at least 1", field="max_tokens")
        if not math.isfinite(self.length_penalty):
            raise InvalidRequest("length_penalty must be a finite number", field="length_penalty")


@attrs.frozen
class _Beam:
    tokens: tuple[int, ...]  # generated so far
    logprob: float  # their cumulative log-probability
    finish_reason: str = "length"


async def beam_search(engine: Engine, prompt: Prompt, params: BeamSearchParams) -> list[Completion]:
    """The `beam_width` best beams for `prompt` (text or token ids), best first, each as
    a `Completion` whose id is the search's first request's; a step's request that fails
    ends the search with one `Completion` of finish reason `error`. Leaving the call
    cancels the step's requests."""
    ids = await engine.encode(prompt)
    steps = engine.fit(len(ids), params.max_tokens, params.context)  # as a request's
    eos = set(() if params.ignore_eos else engine.tokenizer.eos_token_ids)
    options: dict[str, Any] = dict(
        max_tokens=1,
        logprobs=2 * params.beam_width,
        temperature=params.temperature,
        ignore_eos=True,  # the search decides what an EOS means
        lora=params.lora,
        owner=params.owner,
        priority=params.priority,
    )
    live, finished = [_Beam((), 0.0)], list[_Beam]()
    first_id = ""
    for _ in range(steps):
        done = await _step(engine, ids, live, options)
        first_id = first_id or done[0].id
        if failed := next((out for out in done if out.finish_reason == "error"), None):
            return [_failure(first_id, len(ids), failed)]
        if any(out.finish_reason == "cancelled" for out in done):
            live = [attrs.evolve(beam, finish_reason="cancelled") for beam in live]
            break
        live = _extend(live, done, eos, params, finished)
        if not live:
            break
    best = _best(finished + live, len(ids), eos, params.length_penalty)[: params.beam_width]
    decode = engine.tokenizer.decode
    return [
        Completion(
            id=first_id,
            text=decode(_text_tokens(beam, eos), skip_special_tokens=params.skip_special_tokens),
            token_ids=beam.tokens,
            finish_reason=beam.finish_reason,
            prompt_tokens=len(ids),
            cumulative_logprob=beam.logprob,
        )
        for beam in best
    ]


def _failure(first_id: str, prompt_tokens: int, failed: Completion) -> Completion:
    """The search's one result when a step's request failed."""
    return Completion(
        id=first_id,
        text="",
        token_ids=(),
        finish_reason="error",
        prompt_tokens=prompt_tokens,
        error=failed.error,
    )


def _extend(
    live: list[_Beam],
    done: list[Completion],
    eos: set[int],
    params: BeamSearchParams,
    finished: list[_Beam],
) -> list[_Beam]:
    """One round: each live beam extended by each of its candidate tokens; a candidate
    that is an EOS goes to `finished`, the `beam_width` best of the rest are returned."""
    candidates: list[tuple[float, int, _Beam]] = []
    for beam, out in zip(live, done, strict=True):
        assert out.logprobs
        step = out.logprobs[0]
        scores = dict(step.top)
        scores.setdefault(out.token_ids[0], step.logprob)  # the token drawn
        for token, logprob in scores.items():
            if token in eos:
                kept = (token,) if params.include_stop_str_in_output else ()
                finished.append(_Beam(beam.tokens + kept, beam.logprob + logprob, "stop"))
            else:
                candidates.append((beam.logprob + logprob, token, beam))
    candidates.sort(key=lambda c: -c[0])
    width = params.beam_width
    return [_Beam(beam.tokens + (token,), score) for score, token, beam in candidates[:width]]


def _best(beams: list[_Beam], prompt_tokens: int, eos: set[int], penalty: float) -> list[_Beam]:
    """`beams` best first, by cumulative log-probability / length ** length_penalty (the
    length counts the prompt, and not a final EOS), as vLLM ranks them."""

    def rank(beam: _Beam) -> float:
        length = prompt_tokens + len(beam.tokens)
        if beam.tokens and beam.tokens[-1] in eos:
            length -= 1  # vLLM's rule: a kept EOS does not count
        return beam.logprob / (max(length, 1) ** penalty)

    return sorted(beams, key=rank, reverse=True)


def _text_tokens(beam: _Beam, eos: set[int]) -> list[int]:
    """A beam's tokens but the EOS that ended it, which is never in its text."""
    tokens = list(beam.tokens)
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


async def _step(
    engine: Engine, prompt: list[int], beams: list[_Beam], options: dict[str, Any]
) -> list[Completion]:
    """Each beam's next-token request, all at once (they share the engine's steps)."""
    return await gather(
        [functools.partial(engine.generate, prompt + list(b.tokens), **options) for b in beams]
    )


async def gather(calls: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """The calls' results, in order, the calls run at once. The first that raises
    cancels the others, and its exception is raised as it is (not in a group), so an
    `InvalidRequest` or `EngineOverloaded` reaches the caller as itself."""
    results: list[Any] = [None] * len(calls)
    failures: list[Exception] = []

    async def run(index: int, call: Callable[[], Awaitable[T]]) -> None:
        try:
            results[index] = await call()
        except Exception as exc:
            failures.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for index, call in enumerate(calls):
            tg.start_soon(run, index, call)
    if failures:
        raise failures[0]
    return results
