"""Tool calling on `/v1/chat/completions`: OpenAI's `tools` and `tool_choice`.

The tools reach the chat template as `tools` (as transformers passes them) unless
`tool_choice` is `none`. What the model writes becomes calls according to the choice:

* `auto` (the default with tools): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks in the text are the calls: the Hermes format that Qwen2.5 and
  Qwen3 are trained on (vLLM's `hermes` parser). The text before the first block is the
  message's content; `finish_reason` is `tool_calls`. Without a well-formed block, the
  text is the content.
* `required`: the output is constrained (structured output, `kernels/guided.py`) to a
  JSON array of one or more `{"name", "parameters"}` calls of the given tools, as vLLM
  does; `finish_reason` is `tool_calls`.
* a named function: the output is constrained to that function's `parameters` schema
  and is its arguments; `finish_reason` stays `stop`, as OpenAI's.

`parallel_tool_calls: false` keeps one call. Streamed, a named function's arguments
go out as they come (`argument_deltas`, OpenAI's and vLLM's way); under `auto` the
content goes out as it comes up to a `<tool_call>` tag (`HeldContent`), and the calls
(and any content left) in one delta at the end; under `required`, all at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict, Field

from .errors import ApiError

#: vLLM's `hermes` format: one call per block, JSON inside.
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of its arguments")
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@attrs.frozen
class ToolPlan:
    """What a chat call's tools ask: `mode` is none, auto, required or function."""

    mode: str
    tools: tuple[ToolDef, ...] = ()
    name: str | None = None  # the function a named choice calls
    single: bool = False  # parallel_tool_calls: false

    @classmethod
    def of(
        cls, tools: list[ToolDef] | None, choice: ToolChoice | None, parallel: bool | None
    ) -> ToolPlan:
        """The plan of a body's fields; a 400 naming the field where they disagree."""
        tools = tools or []
        if choice is None:
            choice = "auto" if tools else "none"
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in tools]
            if choice.function.name not in names:
                raise ApiError(
                    400,
                    f"tool_choice names {choice.function.name!r}, which tools do not define",
                    param="tool_choice",
                )
            return cls("function", tuple(tools), choice.function.name, parallel is False)
        if choice != "none" and not tools:
            raise ApiError(400, f'tool_choice "{choice}" needs tools', param="tool_choice")
        return cls(choice, tuple(tools), None, parallel is False)

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    @property
    def streams_arguments(self) -> bool:
        """A stream can send the output as it comes: a named function's arguments."""
        return self.mode == "function"

    def argument_deltas(self, text: str, first: bool) -> list[dict[str, Any]]:
        """A stream's `tool_calls` delta for more of a named function's arguments: the
        first names the call, the rest add to its arguments."""
        assert self.name is not None
        if first:
            return [_call(self.name, text)]
        return [{"function": {"arguments": text}}]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (none with `tool_choice: none`)."""
        if not self.calls_tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def guide(self) -> str | None:
        """The JSON schema the output must match (required and named choices)."""
        if self.mode == "function":
            return json.dumps(self._parameters(self.name))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": self._parameters(tool.function.name),
                },
                "required": ["name", "parameters"],
            }
            for tool in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.single:
            array["maxItems"] = 1
        return json.dumps(array)

    def answer(self, text: str, finish_reason: str) -> tuple[str | None, list[dict], str]:
        """A choice's message content, its tool calls and its finish reason."""
        if self.mode == "function":
            assert self.name is not None
            return None, [_call(self.name, text)], finish_reason
        if self.mode == "required":
            calls = _required_calls(text)
            if calls is None:  # cut short (length) or cancelled: no whole array
                return text, [], finish_reason
            return None, calls[:1] if self.single else calls, "tool_calls"
        if self.mode == "auto":
            content, calls = _hermes_calls(text)
            if calls:
                return content, calls[:1] if self.single else calls, "tool_calls"
        return text, [], finish_reason

    def _parameters(self, name: str | None) -> dict[str, Any]:
        for tool in self.tools:
            if tool.function.name == name:
                return tool.function.parameters or {"type": "object"}
        raise KeyError(name)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _required_calls(text: str) -> list[dict[str, Any]] | None:
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list):
        return None
    return [
        _call(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
        for call in calls
        if isinstance(call, dict) and isinstance(call.get("name"), str) and "parameters" in call
    ]


def _hermes_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The calls of the well-formed `<tool_call>` blocks in `text`, and the content
    before the first block (None if only whitespace)."""
    first, calls = _hermes_blocks(text)
    if not calls:
        return text, []
    return text[:first].strip() or None, calls


def _hermes_blocks(text: str) -> tuple[int, list[dict[str, Any]]]:
    """Where the first well-formed `<tool_call>` block starts (the text's end if
    none), and the calls of all of them."""
    calls = []
    first = None
    for match in CALL_BLOCK.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(_call(call["name"], arguments))
        first = match.start() if first is None else first
    return (len(text) if first is None else first), calls


TAG = "<tool_call>"


class HeldContent:
    """(a streamed choice under `auto`) The content it can send as it comes: its text
    up to a `<tool_call>` tag, holding back an end that could be the start of one."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of `text` sent
        self.held = False  # a tag came: the rest waits for the end

    def feed(self, text: str) -> str:
        """Take more text; the part that can go out now."""
        self.text += text
        if self.held:
            return ""
        at = self.text.find(TAG, self.sent)
        if at >= 0:
            self.held, end = True, at
        else:
            end = len(self.text) - _tag_start(self.text)
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece

    def rest(self, text: str) -> str:
        """At the end, with the whole `text`: the content still to send (up to the
        first well-formed block, or all of it without one)."""
        first, _calls = _hermes_blocks(text)
        return text[self.sent : first]


def _tag_start(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>`."""
    for length in range(min(len(TAG) - 1, len(text)), 0, -1):
        if TAG.startswith(text[-length:]):
            return length
    return 0
