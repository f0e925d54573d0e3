"""The step actor: the one task that owns the model and forms every batch.

Each iteration: ask the scheduler for the next step; drop every sequence whose request
ended or was cancelled (right before launching the kernels); pin the blocks the step
reads and writes (+1 each); run the forward and sampling in a worker thread, or send
them to the model worker process and await its answer, so the event loop stays
responsive; unpin; advance the sequences and hand each live request its token with a
synchronous call, never awaiting a consumer.

It never ends a request and never calls back into the engine. A request that ends
while its sequence is in the running step calls `leave` from its own cleanup: the
chunk is marked in the step's `StepControl` (the forward drops its rows at its next
checkpoint, before each layer's attention and MLP, and stops when nobody is left,
`StepAborted`) and its pins are dropped at once, so its blocks are free before `leave`
returns: the cancel never waits for the forward. That is safe because blocks are
handed out only by `Scheduler.schedule`, which this actor calls between steps, never
while a forward runs: the pool is fenced for the step (`BlockPool.fence`), like a
device allocator whose frees are ordered before the next kernel that could reuse the
memory. Idle, the actor runs the thread worker's warm-up steps one at a time
(`execution/warm_up.py`; a wake-up stops the running one at its next checkpoint), then
sleeps on a wake-up event. The readers of a step's tokens are
woken a group at a time by `ReaderWakeups`, a task of its own, while the next forward
runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus

from kvscope.cache.block_pool import BlockPool
from kvscope.cache.block_table import blocks_needed
from kvscope.config import SpeculativeConfig
from kvscope.execution.runner_protocol import KVCacheLost, Runner
from kvscope.execution.step_input import ChunkInput, StepInput
from kvscope.execution.warm_up import WarmUp
from kvscope.kernels.sampling import Sampled
from kvscope.models.llama import StepAborted

from .messages import StepStatistics
from .scheduler import ScheduledStep, Scheduler
from .sequence import Sequence
from .speculation import Speculation
from .wakeups import ReaderWakeups

log = logging.getLogger(__name__)


class StepActor:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        pool: BlockPool,
        *,
        debug: bool = False,
        on_step: Callable[[float, float, int], None] | None = None,
        warm_up: WarmUp | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.pool = pool
        self.debug = debug
        self.control = runner.new_control()
        self._wakeup = anyio.Event()
        self.readers = ReaderWakeups()
        # The running step, by chunk: its sequences and the blocks pinned for each
        # (None once unpinned; empty between steps).
        self._in_flight: list[Sequence] = []
        self._pins: list[list[int] | None] = []
        self._limiter = anyio.CapacityLimiter(1)
        self._on_step = on_step
        self.warm_up = warm_up  # run while idle (the thread worker's; None otherwise)
        self.speculation = Speculation.of(speculative)  # drafts rows' next tokens (None: off)
        self._warming = False
        #: Called in the model's thread right before each forward (a test may hold a
        #: step in flight there).
        self.before_forward: list[Callable[[], None]] = []
        self.steps = 0
        self.aborted_steps = 0
        self.preemptions = 0
        self.tokens_generated = 0

    def wake(self) -> None:
        self._wakeup.set()
        if self._warming:
            self.control.abort.set()  # the warm-up gives way at its next checkpoint

    def stop_forward(self) -> None:
        """Stop the running forward at its next checkpoint (shutdown)."""
        self.control.abort.set()

    def leave(self, seq: Sequence) -> bool:
        """(a request's cleanup) `seq` ended: unpin its blocks now, have the forward
        drop its rows at the next checkpoint, and stop the forward if nobody is left.
        Returns whether the running step held it."""
        if seq not in self._in_flight:
            return False
        index = self._in_flight.index(seq)
        if self._pins[index] is None:
            return False
        self.control.cancel(index)
        if all(other.skippable() for other in self._in_flight):
            self.control.abort.set()
        self._unpin(index)
        return True

    def statistics(self) -> StepStatistics:
        return StepStatistics(
            steps=self.steps,
            aborted_steps=self.aborted_steps,
            preemptions=self.preemptions,
            tokens_generated=self.tokens_generated,
            # the requests the running step still serves (not those that left it)
            in_flight=tuple(
                seq.id
                for seq, pins in zip(self._in_flight, self._pins, strict=True)
                if pins is not None
            ),
            abort_requested=self.control.abort.is_set(),
            spec_accepted_per_position=tuple(self.speculation.accepted_per_position)
            if self.speculation is not None
            else (),
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.readers.run)
            task_status.started()
            await self._steps()

    async def _steps(self) -> None:
        while True:
            if self.runner.cache_lost:
                self._recompute_lost_cache()
            if self.speculation is not None:
                self.speculation.propose(self.scheduler.running, self.scheduler.num_waiting)
            step = self.scheduler.schedule() if self.scheduler.has_work() else None
            if step is not None:
                self.preemptions += len(step.preempted)
            live = [(seq, n) for seq, n in step.chunks if not seq.skippable()] if step else []
            if live:
                await self._run_step(live, step)  # type: ignore[arg-type]
                # What became ready during the step (a DELETE, the first readers'
                # wake-up) runs before the next step is formed: the step's own work on
                # the loop is cut in two, neither half long.
                await anyio.lowlevel.checkpoint()
                continue
            if step is not None and step.preempted:
                await anyio.lowlevel.checkpoint()
                continue  # admission was held back for this step; try again
            # Idle, or all that was scheduled has ended and its cleanup (which wakes
            # us) has yet to run.
            if self.debug and step is None:
                self.pool.check_integrity()
            if step is None and self.warm_up is not None and not self.warm_up.done:
                if not self._wakeup.is_set():
                    await self._warm_up_once()
                    continue
            await self._wakeup.wait()
            self._wakeup = anyio.Event()

    async def _run_step(self, live: list[tuple[Sequence, int]], step: ScheduledStep) -> None:
        live.sort(key=lambda item: item[1] != 1 + len(item[0].draft))  # decode rows first
        work = StepInput([self._chunk_input(seq, n) for seq, n in live], step.copies)
        copy_sources = [src for src, _ in step.copies]
        self.pool.acquire(copy_sources)
        pinned = [list(seq.block_table) for seq, _ in live]
        for pins in pinned:
            self.pool.acquire(pins)
        self._pins = list(pinned)
        self._in_flight = [seq for seq, _ in live]
        self.control.reset()
        tokens: list[Sampled | None] | None = None
        failure: BaseException | None = None
        started = time.perf_counter()
        try:
            with self.pool.fence():
                tokens = await self._forward(work)
        except StepAborted:
            self.aborted_steps += 1
        except KVCacheLost:
            pass  # it ran nothing; its requests recompute (the loop's next pass)
        except Exception as exc:  # a model failure fails this step's requests, not the engine
            log.exception("model step failed")
            failure = exc
        finally:
            forward_seconds = time.perf_counter() - started
            for index in range(len(live)):
                self._unpin(index)
            self.pool.release(copy_sources)
            self._in_flight, self._pins = [], []
        self.steps += 1
        if tokens is not None:  # a finished step: its time teaches the time budget
            self.scheduler.step_budget.observe(forward_seconds, sum(n for _, n in live))
        self._deliver(live, tokens, failure)
        if self._on_step is not None:
            self._on_step(started, forward_seconds, len(live))

    def _recompute_lost_cache(self) -> None:
        """The model worker went away with the K/V cache's contents: the running
        requests compute their tokens again, on the next worker."""
        losses = self.runner.caches_lost
        recomputed = self.scheduler.recompute_all()
        self.preemptions += recomputed
        self.runner.recovered(losses)
        log.warning(
            "the model worker's K/V cache is gone with it: %d running request(s) compute"
            " their tokens again, and the prefix cache is emptied",
            recomputed,
        )

    async def _warm_up_once(self) -> None:
        """Run the next warm-up step in the model thread; a wake-up stops it."""
        assert self.warm_up is not None
        self.control.reset()
        self._warming = True
        try:
            await anyio.to_thread.run_sync(
                self.warm_up.run_next, self.control, limiter=self._limiter
            )
        finally:
            self._warming = False

    def _deliver(
        self,
        live: list[tuple[Sequence, int]],
        tokens: list[Sampled | None] | None,
        failure: BaseException | None,
    ) -> None:
        """Hand each request still live its token, or the step's failure; their readers
        wake a group at a time (`ReaderWakeups`) while the next forward runs."""
        waiters: list[anyio.Event] = []
        for index, (seq, num_new) in enumerate(live):
            if seq.skippable():
                continue
            waiters += seq.owner.take_waiters()
            if failure is not None:
                seq.owner.finish_generation("error", error=f"model step failed: {failure!r}")
            elif tokens is not None:
                self._deliver_row(seq, num_new, tokens[index])
        self.readers.wake(waiters)

    def _deliver_row(self, seq: Sequence, num_new: int, token: Sampled | None) -> None:
        """Count the K/V a step computed for `seq` and hand its request what it drew.
        Of a draft, only the accepted tokens' K/V counts (the rest is rolled back: the
        slots past `num_computed` are written again before anything reads them)."""
        start, draft, seq.draft = seq.num_computed, seq.draft, []
        if draft:
            accepted = token.drafted if token is not None else ()
            if self.speculation is not None:
                self.speculation.record(seq, len(draft), len(accepted))
            for taken, drafted in enumerate(accepted):
                seq.owner.deliver(drafted)  # appended to `seq.tokens` before it counts
                self.tokens_generated += 1
                if seq.skippable():  # a stop, or max_tokens: the rest is not wanted
                    self.scheduler.advance(seq, num_new - len(draft) + taken)
                    return
            num_new += len(accepted) - len(draft)
        self.scheduler.advance(seq, num_new)
        if token is not None and token.prompt_logprobs:
            seq.owner.deliver_prompt_logprobs(start, token.prompt_logprobs)
        if token is not None and token.token is not None:
            seq.owner.deliver(token.token, token.logprobs)
            self.tokens_generated += 1
        elif token is not None and token.embedding is not None:
            seq.owner.deliver_embedding(token.embedding)

    async def _forward(self, work: StepInput) -> list[Sampled | None]:
        """The step's forward and sampling: sent to the model worker process from the
        event loop where the runner can (no thread to wake and no GIL to pass, each way),
        else in the model thread."""
        if not self.before_forward:
            tokens = await self.runner.execute_on_loop(work)
            if tokens is not None:
                return tokens
        return await anyio.to_thread.run_sync(self._execute, work, limiter=self._limiter)

    def _execute(self, work: StepInput) -> list[Sampled | None]:
        """(model thread) Run one step's forward and sampling."""
        for hook in self.before_forward:
            hook()
        return self.runner.execute(work, self.control)

    def _unpin(self, index: int) -> None:
        """Unpin chunk `index`'s blocks (those whose request ended are freed now)."""
        pins = self._pins[index]
        if pins is not None:  # else it left earlier in the step
            self._pins[index] = None
            self.pool.release(pins)

    def _chunk_input(self, seq: Sequence, num_new: int) -> ChunkInput:
        start = seq.num_computed
        end = start + num_new
        # A draft's tokens follow the sequence's own (the scheduler gave them slots).
        tokens = seq.tokens + seq.draft if seq.draft else seq.tokens
        # With `prompt_logprobs`: each row scores the prompt token after it, if any.
        scored = seq.params.prompt_logprobs is not None
        return ChunkInput(
            token_ids=tokens[start:end],
            start=start,
            block_table=seq.block_table[: blocks_needed(end, self.scheduler.block_size)],
            sample=end == len(tokens),
            params=seq.params,
            generator=seq.generator,
            state=getattr(seq.owner, "sampling", None),
            prompt_targets=seq.tokens[start + 1 : min(end + 1, seq.num_prompt_tokens)]
            if scored
            else [],
            draft=list(seq.draft),
        )
