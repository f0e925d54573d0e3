"""What callers hold: a `Request` (inside `engine.request(...)`), a detached `Job`, and
`DeltaStream`, the iterator over a request's deltas that both use.

A stream only reads the request's log; it never owns the request, so any number of
watchers may read one request, and a watcher that stops reading cancels nothing.
`MergedStream` reads several requests at once (the `n` samples of one call), in the
order their deltas arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

from .messages import Completion, Delta, RequestInfo
from .request import RequestState, wait_any_changed


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


class MergedStream:
    """Async iterator over several requests' deltas as they arrive: `(index, Delta)`
    pairs, and `(index, None)` once request `index` has ended and all of it was read."""

    def __init__(self, states: Sequence[RequestState]) -> None:
        self._states = list(states)
        self._next = [0] * len(self._states)
        self._ended = [False] * len(self._states)

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> tuple[int, Delta | None]:
        while True:
            pending = []
            for index, state in enumerate(self._states):
                if self._ended[index]:
                    continue
                if self._next[index] < len(state.log):
                    self._next[index] += 1
                    return index, state.log[self._next[index] - 1]
                if state.ended.is_set():
                    self._ended[index] = True
                    return index, None
                pending.append(state)
            if not pending:
                raise StopAsyncIteration
            await wait_any_changed(pending)


def merge_streams(handles: Sequence[_Handle]) -> MergedStream:
    """Read several requests' deltas together, in arrival order."""
    return MergedStream([handle._state for handle in handles])


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
