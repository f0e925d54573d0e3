"""The step actor: the one task that owns the model and forms every batch.

Each iteration: ask the scheduler for the next step; drop every sequence whose request
was cancelled (right before launching the kernels); pin the blocks the step reads and
writes (+1 each, so a cancel during the forward cannot free them under it); run the
forward and sampling in a worker thread so the event loop stays responsive; unpin
(blocks whose request was cancelled meanwhile are freed now); advance the sequences and
hand each live request its token with a synchronous call, never awaiting a consumer.

A request cancelled while its sequence is in the running step is dropped from the
batch at the forward's next checkpoint, before each layer's attention and MLP
(`note_cancelled` tells the runner through the step's `StepControl`); the runner hands
its chunk back and its blocks are unpinned, and so released, right then rather than
when the step ends. When every sequence of the step
is cancelled, the forward stops (`StepAborted`). Idle, the actor sleeps on a wake-up
event that any new request sets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus

from kvscope.cache.block_pool import BlockPool
from kvscope.cache.block_table import blocks_needed
from kvscope.models.llama import StepAborted
from kvscope.models.runner import ChunkInput, ModelRunner, StepInput
from kvscope.models.worker import ProcessRunner

from .scheduler import ScheduledStep, Scheduler, Sequence

log = logging.getLogger(__name__)


class StepActor:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner | ProcessRunner,
        pool: BlockPool,
        *,
        debug: bool = False,
        on_released: Callable[[Sequence], None],
        on_step: Callable[[float, float, int], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.pool = pool
        self.debug = debug
        self.control = runner.new_control(self._dropped_by_worker)
        self._wakeup = anyio.Event()
        self._in_flight: list[Sequence] = []  # the running step's sequences, by chunk
        self._pins: list[list[int]] = []  # the blocks pinned for each of them
        self._limiter = anyio.CapacityLimiter(1)
        self._on_released = on_released
        self._on_step = on_step
        self.steps = 0
        self.aborted_steps = 0

    def wake(self) -> None:
        self._wakeup.set()

    @property
    def abort(self) -> threading.Event:
        """Set to stop the running forward at its next checkpoint (shutdown)."""
        return self.control.abort

    def note_cancelled(self, seq: Sequence) -> None:
        """`seq`, in the running step, was cancelled: drop it at the next checkpoint, and stop
        the forward if nobody is left."""
        if seq not in self._in_flight:
            return
        self.control.cancel(self._in_flight.index(seq))
        if all(other.skippable() for other in self._in_flight):
            self.control.abort.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            step = self.scheduler.schedule() if self.scheduler.has_work() else None
            live = [(seq, n) for seq, n in step.chunks if not seq.skippable()] if step else []
            if live:
                await self._run_step(live, step)  # type: ignore[arg-type]
                continue
            if step is not None and step.preempted:
                await anyio.lowlevel.checkpoint()
                continue  # admission was held back for this step; try again
            # Idle, or all that was scheduled is cancelled and its cleanup (which wakes
            # us) has yet to run.
            if self.debug and step is None:
                self.pool.check_integrity()
            await self._wakeup.wait()
            self._wakeup = anyio.Event()

    async def _run_step(self, live: list[tuple[Sequence, int]], step: ScheduledStep) -> None:
        live.sort(key=lambda item: item[1] != 1)  # decode rows first
        work = StepInput([self._chunk_input(seq, n) for seq, n in live], step.copies)
        copy_sources = [src for src, _ in step.copies]
        self.pool.acquire(copy_sources)
        self._pins = [list(seq.block_table) for seq, _ in live]
        for pins in self._pins:
            self.pool.acquire(pins)
        for seq, _ in live:
            seq.in_step = True
        self._in_flight = [seq for seq, _ in live]
        self.control.reset()
        tokens: list[int | None] | None = None
        failure: BaseException | None = None
        started = time.perf_counter()
        try:
            tokens = await anyio.to_thread.run_sync(
                self.runner.execute, work, self.control, limiter=self._limiter
            )
        except StepAborted:
            self.aborted_steps += 1
        except Exception as exc:  # a model failure fails this step's requests, not the engine
            log.exception("model step failed")
            failure = exc
        finally:
            forward_seconds = time.perf_counter() - started
            self._unpin(range(len(live)))
            self.pool.release(copy_sources)
            self._in_flight, self._pins = [], []
        self.steps += 1
        if failure is not None:
            for seq, _ in live:
                seq.owner.finish_generation("error", error=f"model step failed: {failure!r}")
        elif tokens is not None:
            for (seq, num_new), token in zip(live, tokens, strict=True):
                if seq.skippable():
                    continue
                self.scheduler.advance(seq, num_new)
                if token is not None:
                    seq.owner.deliver(token)
        if self._on_step is not None:
            self._on_step(started, forward_seconds, len(live))

    def _unpin(self, chunks: range | list[int]) -> None:
        """Unpin these chunks' blocks; a cancelled one's blocks are released now."""
        for index in chunks:
            seq = self._in_flight[index]
            if not seq.in_step:
                continue  # dropped earlier in the step
            seq.in_step = False
            self.pool.release(self._pins[index])
            if seq.release_pending:
                seq.release_pending = False
                self._on_released(seq)

    def _dropped_by_worker(self, chunks: list[int]) -> None:
        """(worker thread) The runner dropped these chunks: unpin them on the loop now."""
        anyio.from_thread.run_sync(self._unpin, chunks)

    def _chunk_input(self, seq: Sequence, num_new: int) -> ChunkInput:
        start = seq.num_computed
        end = start + num_new
        return ChunkInput(
            token_ids=seq.tokens[start:end],
            start=start,
            block_table=seq.block_table[: blocks_needed(end, self.scheduler.block_size)],
            sample=end == len(seq.tokens),
            params=seq.params,
            generator=seq.generator,
        )
