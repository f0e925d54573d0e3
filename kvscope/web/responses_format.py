"""How a response of the Responses API is shown: the response object, and its stream.

`ResponseView` is one response: its id, what its body asked (shown back in every
snapshot, as OpenAI's are) and the ids of its output items, which derive from the
response's id, so a stream's items and the stored response's are the same items. Its
status follows the request's end: `stop` is `completed` (a tool call too), `length`
is `incomplete` (`max_output_tokens`), a cancel is `cancelled`, an error `failed`.

`ResponseEvents` is a stream's events: `response.created` and
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
With a reasoning parser (`reasoning.py`) the reasoning is an item of its own, first,
streamed as `response.reasoning_text.delta` events and done before the answer's items
open.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from kvscope import Completion
from kvscope.kernels.sampling import TokenLogprobs
from kvscope.models.tokenizer import Tokenizer

from .openai_format import token_entries
from .reasoning import NONE as NO_REASONING
from .reasoning import ReasoningParser, ReasoningStream
from .responses_schemas import ResponsesBody
from .sse import dumps
from .tool_parsers import CallStream
from .tools import ToolPlan

#: The response status each finish reason leads to.
STATUS_OF_FINISH = {
    "stop": "completed",
    "tool_calls": "completed",
    "length": "incomplete",
    "cancelled": "cancelled",
    "error": "failed",
}
#: The stream's last event for each final status.
FINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


def usage(result: Completion) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


class ResponseView:
    """One response's snapshots, from what its body asked and how its request ended."""

    def __init__(
        self,
        response_id: str,
        body: ResponsesBody,
        model: str,
        shown: dict[str, Any],
        plan: ToolPlan | None = None,
        *,
        tokenizer: Tokenizer | None = None,  # to show log-probabilities, if asked
        reasoning: ReasoningParser = NO_REASONING,
    ) -> None:
        self.id = response_id
        self.body = body
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.plan = plan or body.tool_plan  # read by the server's parser, as the route gives it
        self.created_at = int(time.time())
        choice = body.tool_choice
        self._head = {
            "id": response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": model,
            "background": body.background,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "text": {"format": body.text_format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else self.plan.mode,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "truncation": body.truncation or "disabled",
            "user": body.user,
            "top_logprobs": body.top_logprobs,
            **shown,  # the sampling values it ran with (temperature, top_p)
        }
        if body.service_tier is not None:
            self._head["service_tier"] = body.service_tier

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def call_ids(self, index: int) -> tuple[str, str]:
        """The item id and the call id of the response's `index`-th function call."""
        tail = f"{self.id.removeprefix('resp_')}_{index}"
        return f"fc_{tail}", f"call_{tail}"

    def snapshot(self, status: str, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The response as it stands: `queued` or `in_progress` before its end."""
        return {
            **self._head,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "output": output or [],
            "usage": None,
            "completed_at": None,
        }

    def outcome(
        self, result: Completion
    ) -> tuple[str | None, str | None, list[tuple[str, str]], str]:
        """The reasoning and the message's text (None for none), the calls (name,
        arguments) and the status of a request's end."""
        thought, said = self.reasoning.split(result.text)
        content, calls, reason = self.plan.answer(said or "", result.finish_reason)
        pairs = [(call["function"]["name"], call["function"]["arguments"]) for call in calls]
        if not content and (pairs or said is None):
            content = None
        return thought, content, pairs, STATUS_OF_FINISH.get(reason, "completed")

    @property
    def reasoning_id(self) -> str:
        return "rs_" + self.id.removeprefix("resp_")

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def message_item(
        self, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [_text_part(text, logprobs)],
        }

    def logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None
    ) -> list[dict[str, Any]]:
        """The tokens' log-probabilities as an output text shows them (none unless
        asked)."""
        if logprobs is None or self.tokenizer is None:
            return []
        return token_entries(self.tokenizer, token_ids, logprobs)

    def call_item(self, index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
        item_id, call_id = self.call_ids(index)
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def final(self, result: Completion) -> dict[str, Any]:
        """The whole response once its request has ended."""
        thought, content, calls, status = self.outcome(result)
        item_status = _item_status(status)
        output = [self.reasoning_item(thought, item_status)] if thought is not None else []
        if content is not None:  # all of the text, when no call was read out of it
            logprobs = self.logprobs(result.token_ids, result.logprobs)
            output.append(self.message_item(content, item_status, logprobs))
        output += [
            self.call_item(i, name, arguments, item_status)
            for i, (name, arguments) in enumerate(calls)
        ]
        answer = self.snapshot(status, output)
        answer["usage"] = usage(result)
        answer["completed_at"] = int(time.time())
        if status == "incomplete":
            answer["incomplete_details"] = {"reason": "max_output_tokens"}
        elif status == "failed":
            answer["error"] = {"code": "server_error", "message": result.error or "failed"}
        return answer


def _item_status(status: str) -> str:
    """An output item's status once its response ended with `status`."""
    return "completed" if status == "completed" else "incomplete"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


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
        item_status = _item_status(status)
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
                part=_text_part(""),
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
            part=_text_part(self.text, self.logprobs),
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
