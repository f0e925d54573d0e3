"""The request task: one task per request, in its own cancel scope, that owns the
request's whole end of life.

`run_request` opens the request's `CancelScope` (with its timeout as the deadline)
and a task group for its children, queues the sequence and waits until the generation
ends. However it ends (finished, failed, cancelled by id, by its caller's scope, by
its parent, by timeout, by shutdown) its one `finally` reads top to bottom:

1. settle the status (a finish that came first stays a finish) and leave the
   scheduler, dropping the request's block references;
2. leave the running step, if it holds the request: its pins are dropped at once (the
   blocks are free now) and the forward drops its rows at the next checkpoint;
3. stamp the release, write the audit line, publish the end.

All of it is synchronous: the cleanup never waits, for the forward or anything else,
so it cannot be cancelled half-way either. The other actors only signal: the step
actor sets the request's end with `finish_generation`; `RequestState.cancel` cancels
the scope. Children run in the request's task group, so cancelling a request cancels its
whole subtree by structure; the task itself ends when its children have.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import anyio
import attrs
from anyio.abc import TaskStatus

from .audit import AuditLog, record_of
from .registry import Registry
from .request import RequestState
from .scheduler import Scheduler
from .step import StepActor

log = logging.getLogger("kvscope.requests")


class Ledger:
    """The running totals the request tasks keep for `Engine.stats()`, and what is
    told of each end (the metrics)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()  # finished / cancelled / failed
        self.tasks = 0  # request tasks running now: 0 when nothing leaked
        self.admitting = 0  # sequences admitted but not queued yet
        #: Requests running with each LoRA adapter, from admission to their task's end
        #: (an adapter in use is not unloaded).
        self.adapter_users: Counter[str] = Counter()
        self.idle = anyio.Event()  # no live request
        self.idle.set()
        #: Called with each request's state once it is released (metrics).
        self.release_listeners: list[Callable[[RequestState], None]] = []


@attrs.frozen
class Actors:
    """What a request task talks to: the actors themselves, never the engine."""

    scheduler: Scheduler
    step: StepActor
    registry: Registry
    audit: AuditLog
    ledger: Ledger


async def run_request(
    state: RequestState,
    actors: Actors,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """The request task. Its scope is the request: cancelling it ends the request."""
    actors.ledger.tasks += 1
    try:
        with anyio.CancelScope() as scope:
            if state.timeout is not None:
                scope.deadline = anyio.current_time() + state.timeout
            parent_deadline = state.parent.deadline if state.parent is not None else scope.deadline
            state.deadline = min(scope.deadline, parent_deadline)
            state.scope = scope
            async with anyio.create_task_group() as children:
                state.children_group = children
                try:
                    _open(state, actors)
                    # Siblings submitted together join before the caller resumes, so
                    # none can find the family already ended.
                    while state.pending_children:
                        await children.start(run_request, state.pending_children.pop(0), actors)
                    task_status.started()
                    await state.generation_ended.wait()
                finally:
                    _forget_unstarted_children(state, actors.ledger)
                    state.settle(*_cancel_reason(state, scope))
                    state.blocks_released = actors.scheduler.remove(state.seq)
                    state.in_running_step = actors.step.leave(state.seq)
                    actors.step.wake()  # its room in the batch and the pool is free
                    state.mark_released()
                    actors.audit.write(record_of(state))
                    _publish(state, actors.ledger)
    finally:
        state.children_group = None
        _retire(state, actors)
        state.task_done.set()


def _open(state: RequestState, actors: Actors) -> None:
    """Make the request visible (by id, to its parent) and queue its sequence."""
    ledger = actors.ledger
    ledger.admitting -= 1
    actors.registry.add(state)
    if ledger.idle.is_set():
        ledger.idle = anyio.Event()
    if state.parent is not None:
        state.parent.children.append(state)
    actors.scheduler.add(state.seq)
    actors.step.wake()
    log.info(
        "request start id=%s prompt_tokens=%d max_tokens=%d priority=%d parent=%s key=%s",
        state.id,
        len(state.prompt_ids),
        state.params.max_tokens,
        state.priority,
        state.parent.id if state.parent else None,
        state.owner,
    )


def _forget_unstarted_children(state: RequestState, ledger: Ledger) -> None:
    """Samples started with it that never ran (it was cancelled first) stop counting."""
    if state.pending_children:
        ledger.admitting -= len(state.pending_children)
        state.root.family_size -= len(state.pending_children)
        state.pending_children = []


def _publish(state: RequestState, ledger: Ledger) -> None:
    """Count the end, tell the listeners, and end the request's stream."""
    ledger.counts[state.public_status] += 1
    for listener in ledger.release_listeners:
        listener(state)
    state.publish_end()
    log.info(
        "request %s id=%s finish_reason=%s cancel_reason=%s by=%s tokens=%d blocks=%d",
        "cancel" if state.finish_reason == "cancelled" else "finish",
        state.id,
        state.finish_reason,
        state.cancel_reason,
        state.cancelled_by,
        len(state.token_ids),
        state.blocks_released,
    )


def _retire(state: RequestState, actors: Actors) -> None:
    """The task (and its children) ended: move the request to the history."""
    ledger = actors.ledger
    ledger.tasks -= 1
    state.root.family_size -= 1
    if state.params.lora is not None:
        ledger.adapter_users[state.params.lora] -= 1
    actors.registry.retire(state)
    if actors.registry.num_live == 0:
        ledger.idle.set()


def _cancel_reason(state: RequestState, scope: anyio.CancelScope) -> tuple[str, str | None]:
    """Why the request was cancelled, if no `cancel` call said: the deadline, else an
    ancestor's cancellation, else the engine's shutdown; and by whom."""
    if scope.deadline != float("inf") and anyio.current_time() >= scope.deadline:
        return "timeout", "engine"
    if state.parent is not None:
        return "parent", state.parent.id
    return "shutdown", "engine"
