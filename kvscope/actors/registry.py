"""The registry: request id -> `RequestState`, for look-up and cancel by id.

Live requests stay until their task ends; ended ones move to a bounded history so
`GET /requests/{id}` can still answer "finished" or "cancelled" for a while. Ids are
unguessable (128 random bits), so knowing one is the capability to act on it.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

from .request import RequestState


def new_request_id(prefix: str = "req-") -> str:
    return prefix + secrets.token_hex(16)


class Registry:
    def __init__(self, history: int = 10_000) -> None:
        self._live: dict[str, RequestState] = {}
        self._history: OrderedDict[str, RequestState] = OrderedDict()
        self._history_size = history

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live or request_id in self._history

    def add(self, state: RequestState) -> None:
        if state.id in self:
            raise ValueError(f"request id {state.id!r} is already in use")
        self._live[state.id] = state

    def get(self, request_id: str) -> RequestState | None:
        return self._live.get(request_id) or self._history.get(request_id)

    def retire(self, state: RequestState) -> None:
        """The request's task ended: keep it in the bounded history."""
        if self._live.pop(state.id, None) is None:
            return
        self._history[state.id] = state
        while len(self._history) > self._history_size:
            self._history.popitem(last=False)

    def live(self, owner: str | None = None) -> list[RequestState]:
        return [s for s in self._live.values() if owner is None or s.owner == owner]

    @property
    def num_live(self) -> int:
        return len(self._live)
