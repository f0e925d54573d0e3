"""Tool calling on `/v1/chat/completions`: OpenAI's `tools` and `tool_choice`.

The tools reach the chat template as `tools` (as transformers passes them) unless
`tool_choice` is `none`. What the model writes becomes calls according to the choice:

* `auto` (the default with tools): the calls are read out of the text in the format
  the model was trained on (`parsers.tool_calls`: Hermes `<tool_call>` blocks, Mistral's
  `[TOOL_CALLS]`, Llama 3's JSON; the server's `--tool-call-parser`, picked by the
  chat template unless set). The text before the first call is the message's
  content; `finish_reason` is `tool_calls`. Without a well-formed call, the text is the
  content.
* `required`: the output is constrained (structured output, `kernels/guided.py`) to a
  JSON array of one or more `{"name", "parameters"}` calls of the given tools, as vLLM
  does; `finish_reason` is `tool_calls`.
* a named function: the output is constrained to that function's `parameters` schema
  and is its arguments; `finish_reason` stays `stop`, as OpenAI's.

`parallel_tool_calls: false` keeps one call. Streamed, a named function's arguments
go out as they come (`argument_deltas`, OpenAI's and vLLM's way); under `auto` the
content goes out as it comes up to where a call may begin (`HeldContent`), then each
call's name and its arguments as the model writes them (`CallStream`; a call in a form
it cannot stream goes out whole at the end); under `required`, all at the end.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ApiError
from ..parsers.tool_calls import HERMES, HeldContent, ToolParser, tool_call


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
    parser: ToolParser = HERMES  # how `auto` reads calls (the server's, `reading`)

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

    def reading(self, parser: ToolParser) -> ToolPlan:
        """This plan, its calls read by `parser` (the server's)."""
        return attrs.evolve(self, parser=parser)

    def sampling_overrides(self) -> dict[str, Any]:
        """What the request's sampling must change for its calls to be read: a format
        whose markers are special tokens keeps them in the text under `auto`."""
        if self.mode == "auto" and self.parser.keeps_special_tokens:
            return {"skip_special_tokens": False}
        return {}

    def held_content(self) -> HeldContent:
        """What a stream sends of a choice's content as it comes, under `auto`."""
        return HeldContent(self.parser)

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
            return [tool_call(self.name, text)]
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
            return None, [tool_call(self.name, text)], finish_reason
        if self.mode == "required":
            calls = _required_calls(text)
            if calls is None:  # cut short (length) or cancelled: no whole array
                return text, [], finish_reason
            return None, calls[:1] if self.single else calls, "tool_calls"
        if self.mode == "auto":
            first, calls = self.parser.calls(text)
            if calls:
                content = text[:first].strip() or None
                return content, calls[:1] if self.single else calls, "tool_calls"
        return text, [], finish_reason

    def _parameters(self, name: str | None) -> dict[str, Any]:
        for tool in self.tools:
            if tool.function.name == name:
                return tool.function.parameters or {"type": "object"}
        raise KeyError(name)


def _required_calls(text: str) -> list[dict[str, Any]] | None:
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list):
        return None
    return [
        tool_call(call["name"], call["parameters"])
        for call in calls
        if isinstance(call, dict) and isinstance(call.get("name"), str) and "parameters" in call
    ]
