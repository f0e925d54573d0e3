"""A `Sequence`: one request's tokens and KV blocks as the scheduler sees them, and
the one place its status is kept (queued < running < preempted < an end < released).

The scheduler (`scheduler.py`) moves sequences between its queue and its running list;
the step actor reads them to build a step; the request's task (`lifecycle.py`) ends
and removes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import torch

from kvscope.kernels.sampling import TokenLogprobs
from kvscope.params import SamplingParams

from .messages import RequestStatus

_arrivals = itertools.count()


class SequenceOwner(Protocol):
    """The request a sequence belongs to, as the step actor talks to it."""

    def deliver(self, token: int, logprobs: TokenLogprobs | None = None) -> None: ...

    def deliver_prompt_logprobs(self, start: int, logprobs: tuple[TokenLogprobs, ...]) -> None: ...

    def deliver_embedding(self, embedding: bytes) -> None: ...

    def finish_generation(self, reason: str, error: str | None = None) -> None: ...

    def take_waiters(self) -> list[anyio.Event]: ...


class Sequence:
    """One request's tokens and KV blocks as the scheduler sees them."""

    __slots__ = (
        "id",
        "priority",
        "arrival",
        "tokens",
        "num_prompt_tokens",
        "num_computed",
        "num_cached_prompt",
        "first_admitted_at",
        "block_table",
        "block_hashes",
        "num_committed",
        "_status",
        "fork_from",
        "share_target",
        "is_cancelled",
        "params",
        "generator",
        "owner",
        "num_preemptions",
        "cache_salt",
        "draft",
        "drafter",
    )

    def __init__(
        self,
        seq_id: str,
        prompt: list[int],
        *,
        priority: int = 0,
        fork_from: Sequence | None = None,
        is_cancelled: Callable[[], bool] | None = None,
        params: SamplingParams | None = None,
        owner: Any = None,
    ) -> None:
        self.id = seq_id
        self.priority = priority
        self.arrival = next(_arrivals)
        self.tokens = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed = 0
        #: Prompt tokens found computed (a cached prefix, or its parent's) when it was
        #: first admitted; None until then. A preemption's recompute does not count.
        self.num_cached_prompt: int | None = None
        #: When it was first admitted (`time.perf_counter`); None until then.
        self.first_admitted_at: float | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_committed = 0  # leading full blocks registered in the prefix cache
        self._status = RequestStatus.QUEUED
        self.is_cancelled = is_cancelled or (lambda: False)
        self.params: SamplingParams = params or SamplingParams()
        self.generator: torch.Generator | None = None
        self.owner: SequenceOwner = owner
        self.num_preemptions = 0
        #: Starts its prefix-cache hash chain: sequences share cached blocks only with
        #: the same salt (kvscope salts with the API key, see docs/security.md).
        self.cache_salt: bytes | None = None
        #: Tokens proposed for its next step to verify (speculative decoding,
        #: `speculation.py`); not part of `tokens` until accepted.
        self.draft: list[int] = []
        #: Its n-grams' last places and its next draft's length
        #: (`speculation.RowDrafter`); None until it first speculates.
        self.drafter: Any = None
        # A child shares its parent's blocks for their common prefix (fork); it waits
        # for the parent to compute that prefix rather than computing it twice.
        self.fork_from = fork_from
        self.share_target = 0
        # A request that scores its prompt computes all of it (`_shared_prefix`), and
        # one of another LoRA adapter (or none) its own K/V.
        if (
            fork_from is not None
            and self.params.prompt_logprobs is None
            and self.params.lora == fork_from.params.lora
        ):
            common = 0
            for mine, theirs in zip(self.tokens, fork_from.tokens, strict=False):
                if mine != theirs:
                    break
                common += 1
            self.share_target = min(common, len(self.tokens) - 1)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    @property
    def status(self) -> RequestStatus:
        """The request's status, kept here and nowhere else (`RequestState.status`)."""
        return self._status

    @status.setter
    def status(self, value: RequestStatus) -> None:
        # An end is never undone (a preemption before the request leaves, or a second
        # end, changes nothing); only the release follows it.
        if self._status.is_final and value is not RequestStatus.RELEASED:
            return
        self._status = value

    def skippable(self) -> bool:
        return self._status.is_final or self.is_cancelled()

    def __repr__(self) -> str:
        return f"Sequence({self.id!r}, {self.status.name}, computed={self.num_computed}/{len(self.tokens)})"
