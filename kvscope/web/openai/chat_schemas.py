"""The chat request bodies: a message, the options for rendering a chat (vLLM's), and
`POST /v1/chat/completions`' body; and vLLM's `/v1/chat/completions/batch`, whose
`messages` is a list of conversations, each answered as one chat would be. The sampling
fields both routes share are `schemas`'.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kvscope import InvalidRequest

from ..errors import ApiError
from ..native.schemas import sampling_field
from .schemas import OpenAISampling
from .tools import ToolChoice, ToolDef, ToolPlan


def _boolean(value: bool | str) -> bool:
    return value is True or value == "true"


#: Where a decode stage's forwarded prompt ids come (vLLM's name, in its 400s).
FORWARDED_IDS = "kv_transfer_params.prompt_token_ids"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    #: OpenAI's (system, user, assistant, tool, developer) or any other: the chat
    #: template reads it, as vLLM passes it on.
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None

    @property
    def text(self) -> str:
        """Its content as text: a list of parts keeps its text parts (any other part is
        refused, `InvalidRequest`)."""
        content = self.content
        if content is None or isinstance(content, str):
            return content or ""
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatTemplateOptions(BaseModel):
    """vLLM's options for rendering a chat (`/v1/chat/completions`, `/tokenize`)."""

    add_generation_prompt: bool = Field(True, description="open the assistant's turn")
    continue_final_message: bool = Field(
        False, description="end the prompt inside the final (assistant) message"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="more template variables, such as enable_thinking"
    )


class ChatBody(ChatTemplateOptions, OpenAISampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool = Field(
        False, description="vLLM's: the answer begins with the last message, the assistant's"
    )
    ENGINE_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs", "prompt": "messages"}

    max_completion_tokens: int | None = sampling_field("max_tokens", None)
    #: As a boolean, or (vLLM's, whose pydantic reads it so, and its tests send it) as
    #: the string "true" or "false".
    logprobs: Annotated[bool | Literal["true", "false"], AfterValidator(_boolean)] = False
    top_logprobs: int | None = sampling_field("logprobs", description="needs logprobs")
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = Field(None, description="auto by default with tools")
    parallel_tool_calls: bool | None = Field(None, description="false: one call at most")
    kv_transfer_params: dict[str, Any] | None = Field(
        None,
        description="vLLM's disaggregated serving: its prompt_token_ids (a prefill "
        "stage's) are the prompt, the messages not rendered",
    )

    @property
    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def asked_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def engine_names(self) -> dict[str, str]:
        asked = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return {**self.ENGINE_NAMES, "max_tokens": asked}

    @property
    def echoes(self) -> list[str] | None:
        """What each prompt's answers begin with under `echo` (None: nothing): the last
        message, when it is the assistant's (vLLM's rule: the new message continues it)."""
        echoed = _echoed(self.messages) if self.echo else None
        return [echoed] if echoed is not None else None

    def forwarded_prompt(self, vocab_size: int) -> list[int] | None:
        """The prompt ids a prefill stage forwarded in `kv_transfer_params` (vLLM's
        decode-side reuse), used verbatim (None: render the messages, as under `echo`,
        which needs them); ids that are not a non-empty list of the vocabulary's are a
        400 naming `kv_transfer_params.prompt_token_ids`."""
        ids = (self.kv_transfer_params or {}).get("prompt_token_ids")
        if ids is None or self.echo:
            return None
        # bool is an int subclass: hence the exact type.
        if not isinstance(ids, list) or not ids or any(type(i) is not int for i in ids):
            raise ApiError(
                400,
                "kv_transfer_params' prompt_token_ids must be a non-empty list of token ids",
                param=FORWARDED_IDS,
            )
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"token id {bad} in kv_transfer_params' prompt_token_ids is outside the "
                f"vocabulary (0 to {vocab_size - 1})",
                param=FORWARDED_IDS,
            )
        return ids

    @cached_property
    def tool_plan(self) -> ToolPlan:
        """What `tools` and `tool_choice` ask (a 400 naming the field if they disagree)."""
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def derived_sampling(self, max_tokens: int) -> dict[str, Any]:
        derived = super().derived_sampling(max_tokens)
        guide = self.tool_plan.guide()
        if guide is not None:  # a required or named tool call: its arguments' schema
            derived["guided_json"] = guide
        return derived


def _echoed(messages: list[ChatMessage]) -> str | None:
    last = messages[-1]
    return last.text if last.role == "assistant" else None


class BatchChatBody(ChatBody):
    """vLLM's `POST /v1/chat/completions/batch`: `messages` is a list of conversations,
    conversation i answered by choice i as a chat of its own; the other fields apply to
    each. Not streamed, with no tools, no beam search, `n` 1 and no `prompt_logprobs`
    (vLLM's limits; the last has no one prompt to score here)."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(  # type: ignore[assignment]
        min_length=1, description="the conversations, each a chat's messages"
    )

    def conversation(self, index: int) -> ChatBody:
        """Conversation `index` as the chat body it stands for."""
        values = {name: getattr(self, name) for name in ChatBody.model_fields}
        values["messages"] = self.messages[index]
        return ChatBody.model_construct(self.model_fields_set, **values)

    @property
    def echoes(self) -> list[str] | None:
        if not self.echo:
            return None
        return [_echoed(messages) or "" for messages in self.messages]

    def check_batch(self) -> None:
        """A 400 naming the field this route does not take (vLLM's words, where it has
        them)."""
        refused = {
            "use_beam_search": "Batch chat completions do not support beam search. "
            "Please set `use_beam_search` to False.",
            "n": "Batch chat completions do not support `n > 1`. Please set `n` to 1.",
            "stream": "Batch chat completions are not streamed",
            "tools": "Batch chat completions take no tools",
            "tool_choice": "Batch chat completions take no tools: tool_choice may only be none",
            "prompt_logprobs": "Batch chat completions do not score the prompts",
            "kv_transfer_params": "Batch chat completions take no forwarded prompt: "
            "each conversation is its own prompt",
        }
        given = {
            "use_beam_search": self.use_beam_search,
            "n": self.n != 1,
            "stream": self.stream,
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none"),
            "prompt_logprobs": self.prompt_logprobs is not None,
            "kv_transfer_params": bool(self.kv_transfer_params),
        }
        for name, message in refused.items():
            if given[name]:
                raise ApiError(400, message, param=name)
