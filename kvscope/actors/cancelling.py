"""Cancelling a request by id: it and its live subtree (`cancel_tree`), and the report
of what the cancel found and freed (`cancel_and_report`, what `Engine.cancel` and
`DELETE /requests/{id}` return).

Cancelling only signals: each request's own task runs its cleanup (`lifecycle.py`);
the report waits for that task's published end, after the release.
"""

from __future__ import annotations

import time

import attrs

from .messages import CancelReport
from .registry import Registry
from .request import RequestState


async def cancel_and_report(
    registry: Registry, request_id: str, reason: str, by: str | None
) -> CancelReport:
    """Cancel a request and its children; returns once its blocks are released."""
    called = time.perf_counter()
    state = registry.get(request_id)
    if state is None:
        return CancelReport(id=request_id, found=False, status="unknown")
    report = CancelReport(
        id=request_id,
        found=True,
        status=state.public_status,
        cancelled_children=len(state.live_descendants()),
        tokens_generated=len(state.token_ids),
    )
    if not cancel_tree(state, reason, by):
        return report
    await state.ended.wait()  # published after the release
    assert state.released_at is not None
    return attrs.evolve(
        report,
        tokens_generated=len(state.token_ids),
        blocks_released=state.blocks_released,
        release_seconds=state.released_at - called,
        in_running_step=state.in_running_step,
        reply_seconds=time.perf_counter() - called,
    )


def cancel_tree(state: RequestState, reason: str, by: str | None) -> bool:
    """Cancel `state`, or, if it has ended, its live children; True if it was live.

    Cancelling a live request's scope cancels its children by structure; an ended
    request's task lingers only to host its children, which are cancelled one by
    one. Iterative, parents before children: the first live request on each path is
    cancelled with its subtree, and nothing under it is visited.
    """
    if state.cancel(reason, by):
        return True
    stack = [(child, state) for child in reversed(state.children)]
    while stack:
        child, parent = stack.pop()
        if not child.cancel("parent", parent.id):
            stack.extend((grandchild, child) for grandchild in reversed(child.children))
    return False
