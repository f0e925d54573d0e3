"""The registry: request id -> `RequestState`, for look-up and cancel by id.

Live requests stay until their task ends; ended ones move to a history, bounded by
count and by bytes, so `GET /requests/{id}` can still answer "finished" or
"cancelled" for a while. A retired request is folded (its per-token history dropped,
see `RequestState.fold`), so what the history holds is its summary, text and token
ids. Ids are
unguessable (128 random bits), so knowing one is the capability to act on it.
"""

from __future__ import annotations

import secrets
from array import array
from collections import OrderedDict

from kvscope.kernels.sampling import TokenLogprobs

from .request import RequestState

#: Bytes a folded request holds besides its text and token ids: its state, sequence,
#: events and scope (measured with tracemalloc: about 8 KiB).
RETAINED_OVERHEAD = 8 * 1024
#: Bytes one token's `TokenLogprobs` holds, and each alternative in its top k (measured
#: with tracemalloc).
LOGPROBS_BYTES = 96
ALTERNATIVE_BYTES = 128


def _logprobs_bytes(logprobs: TokenLogprobs | None) -> int:
    return 0 if logprobs is None else LOGPROBS_BYTES + ALTERNATIVE_BYTES * len(logprobs.top)


def retained_bytes(state: RequestState) -> int:
    """About what it holds in memory once folded (the history's size budget)."""
    return (
        RETAINED_OVERHEAD
        + len(state.text) * 4  # at most 4 bytes a character; usually 1
        + len(state.token_ids) * array("l").itemsize
        + len(state.children) * 8
        + sum(map(_logprobs_bytes, state.logprobs or ()))
        + sum(map(_logprobs_bytes, state.prompt_logprobs or ()))
        + (len(state.embedding) * state.embedding.itemsize if state.embedding else 0)
    )


def new_request_id(prefix: str = "req-") -> str:
    return prefix + secrets.token_hex(16)


class Registry:
    def __init__(self, history: int = 10_000, history_bytes: int = 64 << 20) -> None:
        self._live: dict[str, RequestState] = {}
        #: Ended requests, oldest first, with the bytes each was counted at.
        self._history: OrderedDict[str, tuple[RequestState, int]] = OrderedDict()
        self._history_size = history
        self._history_bytes = history_bytes
        self.retained_bytes = 0
        #: Ids admitted whose task has not added them yet: the admission's check and the
        #: task's `add` are separated by the task's start, where another request runs.
        self._reserved: set[str] = set()

    def __contains__(self, request_id: str) -> bool:
        return (
            request_id in self._live or request_id in self._history or request_id in self._reserved
        )

    def reserve(self, request_id: str) -> None:
        """Hold a client-chosen id from its admission until its task adds it."""
        self._reserved.add(request_id)

    def unreserve(self, request_id: str) -> None:
        self._reserved.discard(request_id)

    def add(self, state: RequestState) -> None:
        self._reserved.discard(state.id)
        if state.id in self:
            raise ValueError(f"request id {state.id!r} is already in use")
        self._live[state.id] = state

    def get(self, request_id: str) -> RequestState | None:
        state = self._live.get(request_id)
        if state is not None:
            return state
        entry = self._history.get(request_id)
        return entry[0] if entry is not None else None

    def retire(self, state: RequestState) -> None:
        """The request's task ended: keep it in the history, bounded by count and by
        bytes (the oldest go first), without its per-token history."""
        if self._live.pop(state.id, None) is None:
            return
        state.fold()  # its cleanup released it before its task could end
        size = retained_bytes(state)
        self._history[state.id] = (state, size)
        self.retained_bytes += size
        while self._history and (
            len(self._history) > self._history_size or self.retained_bytes > self._history_bytes
        ):
            _, (_, dropped) = self._history.popitem(last=False)
            self.retained_bytes -= dropped

    def live(self, owner: str | None = None) -> list[RequestState]:
        return [s for s in self._live.values() if owner is None or s.owner == owner]

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_retained(self) -> int:
        return len(self._history)
