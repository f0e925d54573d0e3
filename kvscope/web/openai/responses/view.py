"""The Responses API's response object: `ResponseView` is one response, its snapshots
and output items (the stream's events are `format.py`'s).

It holds the response's id, what its body asked (shown back in every snapshot, as
OpenAI's are) and the ids of its output items, which derive from the response's id, so
a stream's items and the stored response's are the same items. Its status follows the
request's end: `stop` is `completed` (a tool call too), `length` is `incomplete`
(`max_output_tokens`), a cancel is `cancelled`, an error `failed`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from kvscope import Completion, Tokenizer, TokenLogprobs

from ...parsers.reasoning import NONE as NO_REASONING
from ...parsers.reasoning import ReasoningParser
from ..format import token_entries
from ..tools import ToolPlan
from .schemas import ResponsesBody

#: The response status each finish reason leads to.
STATUS_OF_FINISH = {
    "stop": "completed",
    "tool_calls": "completed",
    "length": "incomplete",
    "cancelled": "cancelled",
    "error": "failed",
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
        as_ids: bool = False,  # vLLM's --return-tokens-as-token-ids: tokens as token_id:N
    ) -> None:
        self.id = response_id
        self.body = body
        self.tokenizer = tokenizer
        self.as_ids = as_ids
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
            "content": [] if status == "in_progress" else [text_part(text, logprobs)],
        }

    def logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None
    ) -> list[dict[str, Any]]:
        """The tokens' log-probabilities as an output text shows them (none unless
        asked)."""
        if logprobs is None or self.tokenizer is None:
            return []
        return token_entries(self.tokenizer, token_ids, logprobs, as_ids=self.as_ids)

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
        item_status = item_status_of(status)
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


def item_status_of(status: str) -> str:
    """An output item's status once its response ended with `status`."""
    return "completed" if status == "completed" else "incomplete"


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
