"""What callers hold: a `Request` (inside `engine.request(...)`), a detached `Job`, and
`DeltaStream`, the iterator over a request's deltas that both use.

A stream only reads the request's log; it never owns the request, so any number of
watchers may read one request, and a watcher that stops reading cancels nothing.
"""

from __future__ import annotations

from .messages import Completion, Delta, RequestInfo
from .request import RequestState


class DeltaStream:
    """Async iterator over a request's deltas, from its first one, until it ends."""

    def __init__(self, state: RequestState, start: int = 0) -> None:
        self._state = state
        self._next = start

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> Delta:
        state = self._state
        while True:
            if self._next < len(state.log):
                delta = state.log[self._next]
                self._next += 1
                return delta
            if state.ended.is_set():
                raise StopAsyncIteration
            await state.wait_changed()


class _Handle:
    def __init__(self, state: RequestState) -> None:
        self._state = state

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def done(self) -> bool:
        return self._state.ended.is_set()

    @property
    def result(self) -> Completion:
        """The final `Completion`; raises `RuntimeError` while the request runs."""
        return self._state.result

    def info(self) -> RequestInfo:
        return self._state.info()

    def __aiter__(self) -> DeltaStream:
        return DeltaStream(self._state)

    async def wait(self) -> Completion:
        await self._state.ended.wait()
        return self._state.result

    def cancel(self, reason: str = "user", by: str | None = None) -> bool:
        """Cancel without waiting (synchronous); False if it had already ended."""
        return self._state.cancel(reason, by)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, {self._state.status.public})"


class Request(_Handle):
    """A request that lives as long as the `engine.request(...)` block around it."""


class Job(_Handle):
    """A detached request (`engine.submit`), addressable by id until it ends."""
