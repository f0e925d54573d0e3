"""Waking a step's readers a few at a time, so no pass of the event loop runs them all.

A step hands every request in the batch its token at once; woken together, their 32
readers (SSE and WebSocket streams, each formatting its event and writing it to its
socket, ~0.1-0.2 ms here) would all run in one pass of the event loop, and a `DELETE`
or a new request arriving meanwhile would wait the whole pass. The step actor gives
their wake-up events to `ReaderWakeups` instead, yields once (so a cancel that arrived
meanwhile is seen) and launches the next forward; this task sets the events `GROUP` at
a time with a checkpoint between groups, so anything else that is ready runs after at
most one group, and the next forward starts before the readers run, not after them.
The tokens are already delivered (the request's state holds them); only the readers'
wake-up is spread. Measured at 32 streams: the step actor's passes over 2 ms went from
73 to 8 in 30 s; the event-loop lag p99 did not follow (~4 ms before and after), its
long passes being GIL waits and scheduling on the two cores
(docs/benchmarks/README.md, "Measured settings": readers woken a group at a time).
"""

from __future__ import annotations

from collections import deque

import anyio
from anyio.abc import TaskStatus

#: Readers woken in one pass of the event loop.
GROUP = 4


class ReaderWakeups:
    def __init__(self) -> None:
        self._queue: deque[anyio.Event] = deque()
        self._more = anyio.Event()
        self._running = False

    def wake(self, events: list[anyio.Event]) -> None:
        """Set these events from the next pass of the loop on, a group a pass (at once
        if the task is not running: not started yet, or gone at shutdown)."""
        if not self._running:
            for event in events:
                event.set()
        elif events:
            self._queue.extend(events)
            self._more.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The task that sets the events. On its way out (shutdown) it sets every one
        still queued, so no reader is left waiting."""
        self._running = True
        task_status.started()
        try:
            while True:
                await self._more.wait()
                self._more = anyio.Event()
                while self._queue:
                    for _ in range(min(GROUP, len(self._queue))):
                        self._queue.popleft().set()
                    await anyio.lowlevel.checkpoint()  # the woken group runs, then the next
        finally:
            self._running = False
            while self._queue:
                self._queue.popleft().set()
