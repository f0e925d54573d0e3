"""A request's state: `RequestState` is everything one request owns.

Its `Sequence` (the scheduler's view, which keeps the request's one status), its
output so far (a log of `Delta`s that any number of watchers read), its children, and
the facts the audit log records. The step actor hands it tokens with the synchronous
`deliver`, which never waits for a consumer, and ends it with `finish_generation`.

How it ends is decided once: by `finish_generation` (stop, length, error) or by the
cancellation its task's cleanup settles (`settle`), whichever comes first; the other
finds the status final and changes nothing. The task that runs it (`lifecycle.py`)
owns the rest of its end of life.
"""

from __future__ import annotations

import time
from array import array

import anyio
from anyio.abc import TaskGroup

from kvscope.kernels.sampling import Guide, RowState, TokenLogprobs
from kvscope.models.tokenizer import IncrementalDecoder, Tokenizer
from kvscope.params import SamplingParams

from .bad_words import bad_word_ids
from .messages import STATUS_OF_REASON, Delta, RequestStatus
from .sequence import Sequence


class RequestState:
    def __init__(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        priority: int = 0,
        parent: RequestState | None = None,
        owner: str | None = None,
        timeout: float | None = None,
        guide: Guide | None = None,
    ) -> None:
        self.id = request_id
        self.params = params
        self.priority = priority
        self.parent = parent
        #: The family's root (itself for a root) and how many ancestors it has.
        self.root: RequestState = parent.root if parent is not None else self
        self.depth: int = parent.depth + 1 if parent is not None else 0
        #: On a root: the family's members whose task has not ended (the engine counts).
        self.family_size = 0
        #: On a root: bumped at every `cancel` in the family, so that `cancel_requested`
        #: walks the ancestors again only after one of them may have been cancelled.
        self.cancel_epoch = 0
        self._seen_epoch = -1
        self._ancestor_cancelled = False
        #: The earliest deadline of its own scope and its ancestors' (set as it starts).
        self.deadline = float("inf")
        self.children: list[RequestState] = []
        self.pending_children: list[RequestState] = []  # started with it (OpenAI's n)
        self.owner = owner
        self.timeout = timeout
        self.prompt_ids = prompt_ids
        self.num_prompt_tokens = len(prompt_ids)
        #: Set by `fold`: the per-token history is gone, the summary stays.
        self.folded = False
        self.seq: Sequence = Sequence(
            request_id,
            prompt_ids,
            priority=priority,
            fork_from=parent.seq if parent is not None else None,
            is_cancelled=self.cancel_requested,
            params=params,
            owner=self,
        )
        self._init_output(tokenizer, params, guide)
        # Events to wait on, each set in one place: the generation ended (by
        # `finish_generation`, for the task); the end was published, after the release
        # (by `publish_end`, for readers); the task and its children ended.
        self.generation_ended = anyio.Event()
        self.ended = anyio.Event()
        self.task_done = anyio.Event()
        self.scope: anyio.CancelScope | None = None
        self.children_group: TaskGroup | None = None
        #: Why it ended; set with the final status, in `_end`.
        self.finish_reason: str | None = None
        self.cancel_reason: str | None = None
        self.cancelled_by: str | None = None
        self.error: str | None = None
        self.created_wall = time.time()
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.token_times: list[float] = []
        self.cancel_called_at: float | None = None
        self.cancelled_wall: float | None = None
        self.released_at: float | None = None
        self.released_wall: float | None = None
        self.blocks_released = 0
        self.in_running_step = False

    def _init_output(
        self, tokenizer: Tokenizer, params: SamplingParams, guide: Guide | None
    ) -> None:
        """What it generates and publishes, and what sampling reads."""
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(tokenizer.eos_token_ids)
        # What sampling reads beyond the parameters (penalties, min_tokens, a grammar).
        self.sampling: RowState | None = None
        if params.penalized or guide is not None:
            self.sampling = RowState(
                self.seq.tokens,
                self.num_prompt_tokens,
                frozenset(self._stop_ids),
                guide,
                bad_word_ids(tokenizer, params.bad_words),
            )
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        #: With `prompt_logprobs`: one per prompt token, None for the first (nothing
        #: predicts it) and for those no step has scored yet.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None else None
        )
        #: With `embed`: the prompt's embedding (float32 values), once computed.
        self.embedding: array[float] | None = None
        self._decoder = IncrementalDecoder(
            tokenizer, self.prompt_ids, skip_special_tokens=params.skip_special_tokens
        )
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self.text = ""
        self._emitted = 0  # characters of `text` already published
        self.token_ids: list[int] = []
        self.log: list[Delta] = []
        self._waiters: list[anyio.Event] = []  # set at the next delta or the end

    # -- status --------------------------------------------------------------------

    @property
    def status(self) -> RequestStatus:
        """Queued < running < preempted < finished / cancelled / failed < released."""
        return self.seq.status

    @property
    def is_released(self) -> bool:
        """Its end is complete: blocks released, audit line written, end published
        (the cleanup does all three without an await between them)."""
        return self.seq.status is RequestStatus.RELEASED

    @property
    def public_status(self) -> str:
        """What clients see: a released request shows the end it had."""
        status = self.seq.status
        if status is RequestStatus.RELEASED:
            status = STATUS_OF_REASON[self.finish_reason or "cancelled"]
        return status.public

    def cancel_requested(self) -> bool:
        """True once this request or an ancestor was cancelled or timed out.

        Called for every sequence of every step, so it is O(1) unless someone in the
        family was cancelled since the last call; then it walks the ancestors once.
        """
        if self.deadline != float("inf") and anyio.current_time() >= self.deadline:
            return True
        epoch = self.root.cancel_epoch
        if not self._ancestor_cancelled and self._seen_epoch != epoch:
            cancelled = False
            state: RequestState | None = self
            while state is not None:
                if state is not self and state._seen_epoch == epoch:
                    cancelled = state._ancestor_cancelled  # its answer is current
                    break
                if state.scope is not None and state.scope.cancel_called:
                    cancelled = True
                    break
                state = state.parent
            self._seen_epoch, self._ancestor_cancelled = epoch, cancelled
        return self._ancestor_cancelled

    def descendants(self) -> list[RequestState]:
        """Every descendant, parents before their children. Iterative: a walk of the
        tree never recurses in proportion to its depth."""
        found: list[RequestState] = []
        stack = list(reversed(self.children))
        while stack:
            state = stack.pop()
            found.append(state)
            stack.extend(reversed(state.children))
        return found

    def live_descendants(self) -> list[RequestState]:
        return [state for state in self.descendants() if not state.status.is_final]

    # -- ending ----------------------------------------------------------------------

    def cancel(self, reason: str, by: str | None = None) -> bool:
        """Cancel the request's scope (synchronous, idempotent). False if it had ended."""
        if self.status.is_final:
            return False
        self._note_cancel(reason, by)
        if self.scope is not None:
            self.scope.cancel()
        self.root.cancel_epoch += 1
        return True

    def finish_generation(self, reason: str, error: str | None = None) -> None:
        """(step actor) The generation ended by itself (stop, length) or failed; a
        request already ended or cancelled keeps the end it has."""
        if self.status.is_final or self.cancel_requested():
            return
        self.error = error
        self._end(reason)
        self.generation_ended.set()

    def settle(self, cancel_reason: str, by: str | None) -> None:
        """(its task's cleanup) Unless it finished or failed, it was cancelled: record
        why, if no `cancel` call said so first."""
        if self.status.is_final:
            return
        self._note_cancel(cancel_reason, by)
        self._end("cancelled")

    def _note_cancel(self, reason: str, by: str | None) -> None:
        if self.cancel_reason is None:  # the first to ask gives the reason
            self.cancel_reason, self.cancelled_by = reason, by
            self.cancel_called_at = time.perf_counter()
            self.cancelled_wall = time.time()

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        self.seq.status = STATUS_OF_REASON[reason]
        if self.sampling is not None:
            self.sampling.guide = None  # its grammar state goes with the request

    # -- output (called by the step actor, synchronously) ----------------------------

    def deliver(self, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """Take the next generated token: decode it, check the stop conditions."""
        now = time.perf_counter()
        self.seq.tokens.append(token)
        self.token_ids.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        self.token_times.append(now)
        if self.first_token_at is None:
            self.first_token_at = now
        reason = None
        if token in self._stop_ids:
            reason = "stop"
            if self.params.include_stop_str_in_output:
                self.text += self._decoder.feed(token)
        else:
            self.text += self._decoder.feed(token)
            if self.params.stop and self._truncate_at_stop_string():
                reason = "stop"
        guide = self.sampling.guide if self.sampling is not None else None
        if reason is None and guide is not None and guide.done:
            reason = "stop"  # the grammar is complete
        if reason is None and len(self.token_ids) >= self.params.max_tokens:
            reason = "length"
        self._publish(token, flush=reason is not None, logprobs=logprobs)
        if guide is not None and reason is None and guide.error is not None:
            self.finish_generation("error", error=f"structured output: {guide.error}")
        elif reason is not None:
            self.finish_generation(reason)

    def deliver_prompt_logprobs(self, start: int, logprobs: tuple[TokenLogprobs, ...]) -> None:
        """Take the log-probabilities of prompt tokens `start + 1` onwards (a chunk
        from `start` scored them; a recomputed chunk scores them again, alike)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[start + 1 : start + 1 + len(logprobs)] = logprobs

    def deliver_embedding(self, embedding: bytes) -> None:
        """Take the prompt's embedding (an `embed` request): its answer, and its end."""
        self.embedding = array("f", embedding)
        self.finish_generation("stop")

    def _truncate_at_stop_string(self) -> bool:
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, self._emitted - longest)
        found = [(i, s) for s in self.params.stop if (i := self.text.find(s, window_start)) >= 0]
        if not found:
            return False
        at, stop = min(found)
        self.text = self.text[: at + len(stop) if self.params.include_stop_str_in_output else at]
        return True

    def _publish(
        self, token: int | None, *, flush: bool, logprobs: TokenLogprobs | None = None
    ) -> None:
        visible = len(self.text) if flush else max(self._emitted, len(self.text) - self._holdback)
        new_text = self.text[self._emitted : visible]
        self._emitted = visible
        if token is not None or new_text:
            token_ids = (token,) if token is not None else ()
            kept = (logprobs,) if logprobs is not None and self.logprobs is not None else ()
            self.log.append(Delta(new_text, token_ids, kept, self._prompt_logprobs_with(token)))
            self._notify()

    def _prompt_logprobs_with(self, token: int | None) -> tuple[TokenLogprobs | None, ...] | None:
        """The prompt's log-probabilities, for the delta of the first token only."""
        if token is None or self.prompt_logprobs is None or len(self.token_ids) != 1:
            return None
        return tuple(self.prompt_logprobs)

    def take_waiters(self) -> list[anyio.Event]:
        """The events its readers wait on, for a caller that sets them itself (the step
        actor spreads them over `ReaderWakeups`); a delta meanwhile wakes nobody."""
        taken, self._waiters = self._waiters, []
        return taken

    def _notify(self) -> None:
        if self._waiters:
            for waiter in self._waiters:
                waiter.set()
            self._waiters.clear()

    def mark_released(self) -> None:
        """(its task's cleanup) Its blocks are back in the pool: the last status."""
        self.released_at = time.perf_counter()
        self.released_wall = time.time()
        self.seq.status = RequestStatus.RELEASED

    def publish_end(self) -> None:
        """(its task's cleanup) Flush the held-back text and wake every reader."""
        self._publish(None, flush=True)
        self.ended.set()
        self._notify()

    def fold(self) -> None:
        """Drop the per-token history of an ended, released request, keeping what a
        look-up by id needs (its summary, text and token ids) and what a reader still
        reading is owed (the rest of the text and tokens, as one delta)."""
        assert self.status is RequestStatus.RELEASED
        self.folded = True
        self.log = []
        self.token_times = []
        self.token_ids = array("l", self.token_ids)  # type: ignore[assignment]
        self.prompt_ids = []
        self._decoder = None  # type: ignore[assignment]
        self.seq.tokens = []
        self.seq.block_hashes = []
        self.seq.generator = None
