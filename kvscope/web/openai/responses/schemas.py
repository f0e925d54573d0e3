"""The body of `POST /v1/responses` (OpenAI's Responses API) and what it becomes.

The input becomes the chat route's messages (`conversation`): a string is one user
message; items are messages (`input_text` / `output_text` parts), `function_call`
items (an assistant turn's tool calls) and `function_call_output` items (a `tool`
message); a `reasoning` item sent back is dropped, as chat templates drop past turns'
reasoning. `instructions` is a system message before them. Function tools and
`tool_choice` become the chat route's `ToolPlan`; `text.format` a JSON grammar.

As on the other OpenAI routes, a field this module does not declare is a 400 naming
it, and so is an input item or content part of a kind it does not take (images,
files, built-in tools). Ids and statuses that a client sends back with a
previous response's output items have no effect on the prompt and are accepted.
`top_k`, `min_p`, `repetition_penalty`, `seed`, `ignore_eos` and `priority` are vLLM's and
kvscope's extensions, as on the other routes.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from kvscope.params import GENERATION_DEFAULTED, PRIORITY, SamplingParams

from ...errors import ApiError
from ...native.schemas import bounded_field, sampling_field, sampling_kwargs
from ..schemas import MAX_TEMPERATURE
from ..tools import FunctionDef, FunctionName, NamedToolChoice, ToolChoice, ToolDef, ToolPlan


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str
    # What an output part carries when a client sends it back: no effect on the prompt.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


Content = str | list[TextPart]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # commentary or final answer: no effect on the prompt


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: Content
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Item):
    """A previous response's reasoning, sent back: not shown to the template (as chat
    templates drop past turns' reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(value: Any) -> str | None:
    """An item's `type`; a message may leave it out (OpenAI's easy input message)."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class TextFormat(_Item):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # always strict here: the grammar enforces the schema


PLAIN_TEXT = TextFormat.model_validate({"type": "text"})


class TextConfig(_Item):
    format: TextFormat = PLAIN_TEXT


class FunctionTool(_Item):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Item):
    type: Literal["function"]
    name: str


class ResponsesBody(BaseModel):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    #: The body's names of `SamplingParams` fields it spells otherwise (its 400s name them).
    ENGINE_NAMES: ClassVar[dict[str, str]] = {
        "logprobs": "top_logprobs",
        "max_tokens": "max_output_tokens",
        "prompt": "input",
    }

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="text, or message and tool items")
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = sampling_field("max_tokens", None)
    temperature: float = sampling_field("temperature", hi=MAX_TEMPERATURE)
    top_p: float = sampling_field("top_p")
    top_k: int = sampling_field("top_k", description="vLLM's")
    min_p: float = sampling_field("min_p", description="vLLM's; 0 is off")
    repetition_penalty: float = sampling_field("repetition_penalty", description="vLLM's")
    seed: int | None = sampling_field("seed", description="vLLM's: any signed 64-bit integer")
    ignore_eos: bool = SamplingParams.default("ignore_eos")
    priority: int = bounded_field(PRIORITY, 0)
    stream: bool = False
    store: bool = Field(True, description="keep it for GET and previous_response_id")
    background: bool = Field(False, description="answer at once; GET or cancel it by id")
    previous_response_id: str | None = Field(
        None, description="continue a stored response's conversation"
    )
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled", "auto"] | None = Field(
        None, description="auto: the oldest turns go until the answer has room"
    )
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description="the output text's log-probabilities"
    )
    top_logprobs: int | None = sampling_field(
        "logprobs", None, description="alternatives per token; needs include"
    )
    # No effect on the output: accepted, and shown in the response.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None

    @cached_property
    def tool_plan(self) -> ToolPlan:
        """The chat route's plan for these tools (a 400 naming the field if they
        disagree)."""
        tools = [
            ToolDef(
                type="function",
                function=FunctionDef(
                    name=tool.name,
                    description=tool.description,
                    parameters=tool.parameters,
                    strict=tool.strict,
                ),
            )
            for tool in self.tools or ()
        ]
        choice: ToolChoice | None = None
        if isinstance(self.tool_choice, FunctionToolChoice):
            function = FunctionName(name=self.tool_choice.name)
            choice = NamedToolChoice(type="function", function=function)
        else:
            choice = self.tool_choice
        return ToolPlan.of(tools, choice, self.parallel_tool_calls)

    @property
    def logprobs_wanted(self) -> int | None:
        """How many alternatives per token to report (None: no log-probabilities)."""
        if "message.output_text.logprobs" not in (self.include or ()):
            return None
        return self.top_logprobs or 0

    @property
    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None else PLAIN_TEXT

    def to_sampling_params(self, max_tokens: int) -> dict[str, Any]:
        """`SamplingParams` kwargs: each declared `SamplingParams` field by name, then the
        length the route settled, the log-probabilities asked and the guide of
        `text.format` or the tools. A field with a checkpoint generation default goes
        only if the client set it, as on the other routes."""
        fmt = self.text_format
        # A required or named tool call's arguments' schema, or the format's.
        guide: str | dict[str, Any] | None = self.tool_plan.guide()
        if guide is None and fmt.type == "json_object":
            guide = {"type": "object"}
        elif guide is None and fmt.type == "json_schema":
            guide = fmt.schema_
        derived = {"max_tokens": max_tokens, "logprobs": self.logprobs_wanted, "guided_json": guide}
        return sampling_kwargs(
            self, names=self.ENGINE_NAMES, only_if_set=GENERATION_DEFAULTED, derived=derived
        )


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


ITEM = TypeAdapter(InputItem)
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def input_items(given: str | list[dict[str, Any]]) -> list[Item]:
    """The input as items (text is one user message). An item that is not one of
    these is a 400 naming where (`input.3.content.0.type`)."""
    if isinstance(given, str):
        return [MessageItem.model_validate({"role": "user", "content": given})]
    items: list[Item] = []
    for index, raw in enumerate(given):
        try:
            items.append(ITEM.validate_python(raw))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in ("input", index, *first["loc"]))
            raise ApiError(400, f"{where}: {first['msg']}", param=where) from None
    return items


def conversation(items: list[Item]) -> list[dict[str, Any]]:
    """The items as chat messages, in the shape the chat route's `ChatMessage` takes:
    consecutive `function_call` items join the assistant turn before them."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            content = _text(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
    return messages


#: The id prefix of each kind of input item, where the client gave it none.
ITEM_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def listed_items(items: list[Item], response_id: str) -> list[dict[str, Any]]:
    """The items as `GET /v1/responses/{id}/input_items` shows them: each with its
    id (its own, or one made from the response's), `completed`, content as parts."""
    tail = response_id.removeprefix("resp_")
    shown = []
    for index, item in enumerate(items):
        data = item.model_dump(exclude_none=True)
        data.update(status="completed", type=item.type)
        data.setdefault("id", f"{ITEM_PREFIX[item.type]}_{tail}_in{index}")
        if isinstance(item, MessageItem):
            data["content"] = _parts(
                item.content, "output_text" if item.role == "assistant" else "input_text"
            )
        shown.append(data)
    return shown


def _parts(content: Content, kind: str) -> list[dict[str, Any]]:
    """Content as a list of parts (text is one part of `kind`); an output's parts
    carry their `annotations`."""
    if isinstance(content, str):
        content = [TextPart.model_validate({"type": kind, "text": content})]
    parts: list[dict[str, Any]] = [part.model_dump(exclude_none=True) for part in content]
    for part in parts:
        if part["type"] == "output_text":
            part.setdefault("annotations", [])
    return parts
