"""The responses `/v1/responses` keeps (`store`, the default): for `GET`, for `cancel`
of a background one, and for `previous_response_id`.

A `StoredResponse` holds its view, its caller's key, the conversation its prompt was
rendered from (without `instructions`, which a continuation does not inherit, as
OpenAI's rule is), its own input items and its engine `Job`; its final snapshot is
made once, when its request has ended (by whoever looks first, or by its stream). The
store keeps the newest, in memory, within `ServerSettings.stored_responses` and
`stored_responses_bytes`: they do not outlive the server, and under Ray Serve each
replica stores its own (a response's id names its replica, so calls reach it). A key
sees only its own responses; another key's id answers 404, as for requests.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs

from kvscope import Job

from ...errors import ApiError
from .view import ResponseView


@attrs.define(eq=False)
class StoredResponse:
    view: ResponseView
    owner: str | None
    messages: list[dict[str, Any]]
    items: list[dict[str, Any]]  # its input, as `input_items` lists it
    job: Job
    answer: dict[str, Any] | None = None  # the final snapshot, once made

    def current(self) -> dict[str, Any]:
        """The response as it stands: `queued` or `in_progress` until its request ends."""
        if self.answer is None and self.job.done:
            self.answer = self.view.final(self.job.result)
        if self.answer is not None:
            return self.answer
        return self.view.snapshot("queued" if self.job.info().status == "queued" else "in_progress")

    def conversation(self) -> list[dict[str, Any]]:
        """Its messages and its answer's turn, for a response that continues it."""
        answer = self.current()
        if answer["status"] in ("queued", "in_progress"):
            raise ApiError(
                400,
                f"response {self.view.id!r} is still {answer['status']}",
                param="previous_response_id",
            )
        turn: dict[str, Any] = {"role": "assistant", "content": None}
        for item in answer["output"]:
            if item["type"] == "message":
                turn["content"] = "".join(part["text"] for part in item["content"])
            elif item["type"] == "function_call":
                call = {"name": item["name"], "arguments": item["arguments"]}
                turn.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function", "function": call}
                )
        return [*self.messages, turn]

    def size(self) -> int:
        """About the bytes its conversation holds (its texts, counted as characters,
        and a little for each message), counted without serializing it on the loop."""
        size = 0
        for message in self.messages:
            calls = message.get("tool_calls") or ()
            size += 32 + len(message.get("content") or "")
            size += sum(64 + len(call["function"]["arguments"]) for call in calls)
        return size


class ResponseStore:
    """At most `capacity` responses whose conversations hold at most `max_bytes` (each
    holds the whole conversation it continues), oldest forgotten first."""

    def __init__(self, capacity: int, max_bytes: int, keys: dict[str, str]) -> None:
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._keys = keys
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0

    def add(self, entry: StoredResponse) -> None:
        size = entry.size()
        self._entries[entry.view.id] = (entry, size)
        self._bytes += size
        while self._entries and (
            len(self._entries) > self._capacity or self._bytes > self._max_bytes
        ):
            _id, (_entry, forgotten) = self._entries.popitem(last=False)
            self._bytes -= forgotten

    def get(
        self, response_id: str, owner: str | None, *, param: str | None = None
    ) -> StoredResponse:
        """The stored response `response_id` of the key `owner`; a 404 otherwise."""
        entry, _size = self._entries.get(response_id, (None, 0))
        if entry is None or (self._keys and entry.owner != owner):
            raise ApiError(
                404,
                f"Response with id {response_id!r} not found.",  # vLLM's words
                "not_found_error",
                param=param,
            )
        return entry

    def remove(self, response_id: str) -> None:
        _entry, size = self._entries.pop(response_id, (None, 0))
        self._bytes -= size
