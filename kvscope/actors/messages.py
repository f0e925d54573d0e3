"""The small frozen values that cross actor boundaries and reach callers.

* `RequestStatus`: the ordered life of a request; every status above `PREEMPTED` is
  an end, so "has it ended?" is one comparison, and `RELEASED` comes last.
* `Delta`: one piece of a request's stream (new text and token ids).
* `Completion`: a request's final result.
* `CancelReport`: what `Engine.cancel` found and freed.
* `RequestInfo`: a snapshot of one request for `GET /requests/{id}`.
* `StepStatistics`: what the step actor is doing.
"""

from __future__ import annotations

import enum

import attrs

from kvscope.kernels.sampling import TokenLogprobs


class RequestStatus(enum.IntEnum):
    QUEUED = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    CANCELLED = 4
    FAILED = 5
    #: Its blocks are back in the pool, its audit line written, its end published.
    RELEASED = 6

    @property
    def is_final(self) -> bool:
        """It has ended: finished, cancelled or failed (and perhaps released)."""
        return self > RequestStatus.PREEMPTED

    @property
    def public(self) -> str:
        """The name clients see; a preempted request is still running for them (a
        released one shows the end it had, see `RequestState.public_status`)."""
        return "running" if self is RequestStatus.PREEMPTED else self.name.lower()


#: The final status each finish reason leads to.
STATUS_OF_REASON = {
    "stop": RequestStatus.FINISHED,
    "length": RequestStatus.FINISHED,
    "cancelled": RequestStatus.CANCELLED,
    "error": RequestStatus.FAILED,
}


@attrs.frozen
class Delta:
    """New output of a request: `text` decoded so far past the last delta, its tokens
    (and their log-probabilities when the request asked for them)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    #: On the delta of the first generated token, of a request that asked for
    #: `prompt_logprobs`: its prompt's (`Completion.prompt_logprobs`), all scored by then.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@attrs.frozen(kw_only=True)
class Completion:
    id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    #: Prompt tokens it found computed when first admitted (prefix-cache hits, or the
    #: prefix its parent computed); 0 if it ended before admission.
    cached_tokens: int = 0
    cancel_reason: str | None = None
    error: str | None = None
    #: One per token of `token_ids` when the request asked for `logprobs`.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    #: One per prompt token when the request asked for `prompt_logprobs`: None for the
    #: first, and for any the request ended before scoring.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    #: The prompt's embedding, for a request with `embed` that was not cut short.
    embedding: tuple[float, ...] | None = None
    #: A beam's cumulative log-probability (`kvscope.beam_search`).
    cumulative_logprob: float | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@attrs.frozen(kw_only=True)
class CancelReport:
    id: str
    found: bool
    #: The state the request was in when the cancel arrived ("unknown" if not found).
    status: str
    cancelled_children: int = 0
    tokens_generated: int = 0
    blocks_released: int = 0
    #: Seconds from the cancel call to the release of the request's KV blocks.
    release_seconds: float | None = None
    #: True when the request was in the running step: its blocks were freed at once
    #: all the same, and the forward dropped its rows at its next checkpoint.
    in_running_step: bool = False
    #: Seconds from the cancel call to this report, made once the request's end was
    #: published (blocks released, audit line written, its readers woken): what the
    #: server adds to a DELETE's answer after the release.
    reply_seconds: float | None = None

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class RequestInfo:
    id: str
    status: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str | None
    cancel_reason: str | None
    cancelled_by: str | None
    parent: str | None
    children: tuple[str, ...]
    priority: int
    owner: str | None
    created: float
    error: str | None = None
    #: With `embed`, once computed: the prompt's embedding.
    embedding: tuple[float, ...] | None = None

    @property
    def tokens_generated(self) -> int:
        return len(self.token_ids)

    def as_dict(self) -> dict[str, object]:
        data = attrs.asdict(self)
        data["token_ids"] = list(self.token_ids)
        data["embedding"] = None if self.embedding is None else list(self.embedding)
        data["children"] = list(self.children)
        data["tokens_generated"] = self.tokens_generated
        return data


@attrs.frozen(kw_only=True)
class StepStatistics:
    """What the step actor is doing (`Engine.step_statistics()`), for tests and tools."""

    #: Steps run, and those stopped because every sequence in them was cancelled.
    steps: int
    aborted_steps: int
    #: Sequences preempted (their blocks freed, to be recomputed) so far.
    preemptions: int
    #: Tokens the steps handed to requests so far.
    tokens_generated: int
    #: The request ids the running step still serves (empty between steps; a request
    #: that ended mid-step has left it).
    in_flight: tuple[str, ...]
    #: Whether the running forward was told to stop at its next checkpoint.
    abort_requested: bool
    #: Speculative decoding's accepted draft tokens by their position in the draft
    #: (empty with it off).
    spec_accepted_per_position: tuple[int, ...] = ()
