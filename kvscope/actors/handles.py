"""What callers hold: a `Request` (inside `engine.request(...)`), a detached `Job`, and
`DeltaStream`, the iterator over a request's deltas that both use.

A stream only reads the request's log; it never owns the request, so any number of
watchers may read one request, and a watcher that stops reading cancels nothing.
`MergedStream` reads several requests at once (the `n` samples of one call), in the
order their deltas arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from kvscope.params import SamplingParams

from .messages import Completion, Delta, RequestInfo
from .request import RequestState
from .request_views import completion_of, info_of


class _Cursor:
    """Where a reader is in one request's output: the next log entry, and the text and
    tokens it has read (what it is owed once the log is folded, see `RequestState.fold`)."""

    __slots__ = ("chars", "index", "tokens")

    def __init__(self, index: int = 0) -> None:
        self.index, self.chars, self.tokens = index, 0, 0

    def take(self, state: RequestState) -> Delta | None:
        """The next delta, or None if there is none yet (or, once ended, any more)."""
        if state.folded:  # the per-token log is gone: the rest in one delta
            kept = tuple(state.logprobs[self.tokens :]) if state.logprobs is not None else ()
            prompt = state.prompt_logprobs if self.tokens == 0 else None
            delta = Delta(
                state.text[self.chars :],
                tuple(state.token_ids[self.tokens :]),
                kept,
                tuple(prompt) if prompt is not None and state.token_ids else None,
            )
            if not delta.text and not delta.token_ids:
                return None
        elif self.index < len(state.log):
            delta = state.log[self.index]
            self.index += 1
        else:
            return None
        self.chars += len(delta.text)
        self.tokens += len(delta.token_ids)
        return delta


class DeltaStream:
    """Async iterator over a request's deltas, from its first one, until it ends."""

    def __init__(self, state: RequestState, start: int = 0) -> None:
        self._state = state
        self._cursor = _Cursor(start)

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> Delta:
        state = self._state
        while True:
            delta = self._cursor.take(state)
            if delta is not None:
                return delta
            if state.is_released:
                raise StopAsyncIteration
            await wait_any_changed([state])


class MergedStream:
    """Async iterator over several requests' deltas as they arrive: `(index, Delta)`
    pairs, and `(index, None)` once request `index` has ended and all of it was read."""

    def __init__(self, states: Sequence[RequestState]) -> None:
        self._states = list(states)
        self._cursors = [_Cursor() for _ in self._states]
        self._ended = [False] * len(self._states)

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> tuple[int, Delta | None]:
        while True:
            pending = []
            for index, state in enumerate(self._states):
                if self._ended[index]:
                    continue
                ended = state.is_released  # read first: an end comes after its deltas
                delta = self._cursors[index].take(state)
                if delta is not None:
                    return index, delta
                if ended:
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
        return self._state.is_released

    @property
    def params(self) -> SamplingParams:
        """The parameters it runs with: the caller's, with the checkpoint's defaults
        for what it left unset and `max_tokens` as admitted (capped to the context)."""
        return self._state.params

    @property
    def result(self) -> Completion:
        """The final `Completion`; raises `RuntimeError` while the request runs."""
        return completion_of(self._state)

    def info(self) -> RequestInfo:
        return info_of(self._state)

    def __aiter__(self) -> DeltaStream:
        return DeltaStream(self._state)

    async def wait(self) -> Completion:
        await self._state.ended.wait()
        return completion_of(self._state)

    def cancel(self, reason: str = "user", by: str | None = None) -> bool:
        """Cancel without waiting (synchronous); False if it had already ended."""
        return self._state.cancel(reason, by)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, {self._state.public_status})"


class Request(_Handle):
    """A request that lives as long as the `engine.request(...)` block around it."""


class Job(_Handle):
    """A detached request (`engine.submit`), addressable by id until it ends."""


async def wait_any_changed(states: list[RequestState]) -> None:
    """Wait until any of `states` publishes a delta or ends (no task group needed, so a
    stream generator may call it)."""
    event = anyio.Event()
    for state in states:
        state._waiters.append(event)
    try:
        await event.wait()
    finally:
        for state in states:
            if event in state._waiters:
                state._waiters.remove(event)
