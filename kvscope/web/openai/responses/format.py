"""The Responses API's stream: `ResponseEvents` makes a streamed response's SSE
messages from its deltas and its end (the response object itself is `view.py`'s).

The events: `response.created` and
`response.in_progress`; the message's text as `response.output_text.delta` events (a
named function's arguments as `response.function_call_arguments.delta`); each output
item's `added` and `done` events around its parts; and the final snapshot as
`response.completed`, `response.incomplete` (a cancelled response too, its status
`cancelled`) or `response.failed`. Every event carries its `sequence_number` and goes
out as an SSE message whose `event:` is its type; a stream resumed `after` a number
makes the events before it again (from the request's log, so alike) and sends the
rest. Under `tool_choice: auto` the text goes out up to where a call may begin
(`HeldContent`), then each call as a `function_call` item once its name is whole, its
arguments as they come (`CallStream`; a call it cannot stream, whole at the end).
With a reasoning parser (`parsers/reasoning.py`) the reasoning is an item of its own, first,
streamed as `response.reasoning_text.delta` events and done before the answer's items
open.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvscope import Completion, TokenLogprobs

from ...parsers.reasoning import ReasoningStream
from ...parsers.tool_calls import CallStream
from ...sse import dumps
from .view import ResponseView, item_status_of, text_part

#: The stream's last event for each final status.
FINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


class ResponseEvents:
    """A streamed response's SSE messages, fed its deltas and then its end."""

    def __init__(self, view: ResponseView, *, after: int = -1) -> None:
        self.view = view
        self.plan = view.plan
        self.sequence = 0
        self.after = after  # events up to this sequence number are made, not sent
        self.items: list[dict[str, Any]] = []  # the output items opened so far
        self.text = ""  # the message's text sent so far
        self.logprobs: list[dict[str, Any]] = []  # and its tokens' log-probabilities
        self.message: int | None = None  # the message's output index, once opened
        self.held = self.plan.held_content() if self.plan.mode == "auto" else None
        #: auto: the calls in what `held` holds back, each an item as it comes
        self.calls = CallStream(self.held, single=self.plan.single) if self.held else None
        self.call_items: list[int] = []  # the output index of each call streamed
        self.message_done = False
        split = view.reasoning.splits
        self.thinking = ReasoningStream(view.reasoning) if split else None
        self.thought = ""  # the reasoning sent so far
        self.reasoning_at: int | None = None  # the reasoning item's output index, once open
        self.reasoning_done = False
        self.arguments: int | None = None  # a named function's output index
        self.final: dict[str, Any] | None = None  # the last snapshot, once made

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        if data["sequence_number"] <= self.after:
            return b""
        return f"event: {kind}\ndata: {dumps(data)}\n\n".encode()

    def opening(self) -> bytes:
        snapshot = self.view.snapshot("in_progress")
        return self.event("response.created", response=snapshot) + self.event(
            "response.in_progress", response=snapshot
        )

    def feed(
        self,
        text: str,
        first: bool,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[TokenLogprobs] | None = None,
    ) -> bytes:
        """The events for more of the output: its text (`first`: its first token's),
        and its tokens' log-probabilities where asked (no tools, so the text is all
        the message's)."""
        out = b""
        if self.thinking is not None:  # the reasoning first; the rest is the answer
            thought, text = self.thinking.feed(text)
            out += self._reasoning_text(thought)
        mode = self.plan.mode
        if mode == "none":
            return out + self._message_text(text, self.view.logprobs(token_ids, logprobs or None))
        if mode == "auto":
            assert self.held is not None and self.calls is not None
            out += self._message_text(self.held.feed(text))
            for delta in self.calls.advance():
                out += self._streamed_call(delta)
            return out
        if mode == "function" and (text or first):
            return out + self._arguments(text)
        return out  # required: the calls come whole at the end

    def closing(self, result: Completion) -> bytes:
        """The events of the request's end: the rest of the output, every item done,
        and the final snapshot."""
        _thought, content, calls, status = self.view.outcome(result)
        item_status = item_status_of(status)
        said = result.text
        out = b""
        if self.thinking is not None:
            held_back, _answer_rest = self.thinking.finish()  # the answer's: from `said`
            out += self._reasoning_text(held_back)
            said = self.view.reasoning.split(result.text)[1] or ""
        out += self._reasoning_close(item_status)
        if self.plan.mode == "function":
            # No token came: the call is named all the same.
            out += self._arguments("") if self.arguments is None else b""
            assert self.arguments is not None
            out += self._arguments_done(self.arguments, item_status)
        else:
            out += self._message_text(self._rest(said, content))
            if self.message is not None and not self.message_done:
                out += self._message_done(item_status)
            for index in self.call_items:
                out += self._arguments_done(index, item_status)
            for name, arguments in calls[len(self.call_items) :]:
                out += self._whole_call(name, arguments, item_status)
        self.final = self.view.final(result)
        self.final["output"] = self.items
        return out + self.event(FINAL_EVENT[status], response=self.final)

    def _rest(self, text: str, content: str | None) -> str:
        """The message's text not sent yet, of the whole `text`."""
        if self.held is not None:  # auto: what was held back, up to the first call
            if self.call_items or content is None:
                return ""
            return self.held.rest(text)
        if self.plan.mode == "required":  # nothing was sent: the text, if no calls
            return content or ""
        return text[len(self.text) :]

    def _whole_call(self, name: str, arguments: str, status: str) -> bytes:
        """A call found at the end (`auto`, `required`): its item, its arguments in one
        delta, done."""
        index = len(self.items)
        calls_before = sum(item["type"] == "function_call" for item in self.items)
        item = self.view.call_item(calls_before, name, "", "in_progress")
        self.items.append(item)
        out = self.event("response.output_item.added", output_index=index, item=item)
        out += self.event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=arguments,
        )
        item["arguments"] = arguments
        return out + self._arguments_done(index, status)

    def _streamed_call(self, delta: dict[str, Any]) -> bytes:
        """A call as `CallStream` sends it: its item, opened once its name is whole
        (the message before it done), then its arguments' pieces."""
        function = delta["function"]
        if "id" not in delta:
            index = self.call_items[delta["index"]]
            item = self.items[index]
            item["arguments"] += function["arguments"]
            return self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=function["arguments"],
            )
        out = self._reasoning_close("completed")
        if self.message is not None and not self.message_done:
            out += self._message_done("completed")
        index = len(self.items)
        item = self.view.call_item(delta["index"], function["name"], "", "in_progress")
        self.items.append(item)
        self.call_items.append(index)
        return out + self.event("response.output_item.added", output_index=index, item=item)

    def _reasoning_text(self, piece: str) -> bytes:
        """A delta of the reasoning, its item opened first if it is not."""
        if not piece:
            return b""
        out = b""
        if self.reasoning_at is None:
            self.reasoning_at = len(self.items)
            item = self.view.reasoning_item("", "in_progress")
            self.items.append(item)
            out += self.event(
                "response.output_item.added", output_index=self.reasoning_at, item=item
            )
        self.thought += piece
        return out + self.event(
            "response.reasoning_text.delta",
            item_id=self.view.reasoning_id,
            output_index=self.reasoning_at,
            content_index=0,
            delta=piece,
        )

    def _reasoning_close(self, status: str) -> bytes:
        """The reasoning item done (before any item after it opens); once."""
        if self.reasoning_at is None or self.reasoning_done:
            return b""
        self.reasoning_done = True
        index = self.reasoning_at
        done = self.event(
            "response.reasoning_text.done",
            item_id=self.view.reasoning_id,
            output_index=index,
            content_index=0,
            text=self.thought,
        )
        self.items[index] = item = self.view.reasoning_item(self.thought, status)
        return done + self.event("response.output_item.done", output_index=index, item=item)

    def _message_text(self, piece: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        """A delta of the message's text, the message opened first if it is not."""
        if not piece and not logprobs:
            return b""
        out = self._reasoning_close("completed")
        if self.message is None:
            self.message = len(self.items)
            item = self.view.message_item("", "in_progress")
            self.items.append(item)
            out += self.event("response.output_item.added", output_index=self.message, item=item)
            out += self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self.message,
                content_index=0,
                part=text_part(""),
            )
        self.text += piece
        self.logprobs += logprobs or []
        return out + self.event(
            "response.output_text.delta",
            item_id=self.view.message_id,
            output_index=self.message,
            content_index=0,
            delta=piece,
            logprobs=logprobs or [],
        )

    def _message_done(self, status: str) -> bytes:
        assert self.message is not None
        self.message_done = True
        item_id, index = self.view.message_id, self.message
        done = self.event(
            "response.output_text.done",
            item_id=item_id,
            output_index=index,
            content_index=0,
            text=self.text,
            logprobs=self.logprobs,
        )
        done += self.event(
            "response.content_part.done",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=text_part(self.text, self.logprobs),
        )
        item = self.view.message_item(self.text, status, self.logprobs)
        self.items[index] = item
        return done + self.event("response.output_item.done", output_index=index, item=item)

    def _arguments(self, text: str) -> bytes:
        out = self._reasoning_close("completed")
        if self.arguments is None:
            assert self.plan.name is not None
            self.arguments = len(self.items)
            item = self.view.call_item(0, self.plan.name, "", "in_progress")
            self.items.append(item)
            out += self.event("response.output_item.added", output_index=self.arguments, item=item)
        item = self.items[self.arguments]
        item["arguments"] += text
        if not text:
            return out
        return out + self.event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=self.arguments,
            delta=text,
        )

    def _arguments_done(self, index: int, status: str) -> bytes:
        item = self.items[index]
        done = self.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=item["arguments"],
        )
        item = {**item, "status": status}
        self.items[index] = item
        return done + self.event("response.output_item.done", output_index=index, item=item)
