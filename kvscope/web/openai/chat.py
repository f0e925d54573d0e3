"""Turning OpenAI chat messages into prompt token ids.

A model with a chat template renders it (`LoadedModel.render_chat`, exactly as
transformers would); one without (such as `tiny-random`) gets a plain fallback:
`role: content` lines, then `assistant:`. Content given as a list of parts keeps its
text parts. vLLM's options (`ChatTemplateOptions`) apply to both: no generation prompt,
a prompt that ends inside the final assistant message (as transformers'
`continue_final_message` cuts it), and more template variables. Tools (`tools.py`) go
to the template as `tools`; the fallback shows them as a first `tools:` line.
"""

from __future__ import annotations

import json
from typing import Any

from kvscope import Engine, InvalidRequest

from ..errors import ApiError
from .chat_schemas import ChatMessage, ChatTemplateOptions

#: Template variables a request's `chat_template_kwargs` may not set: the renderer's
#: own arguments and the model's special tokens.
RESERVED_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents"}
)


async def chat_prompt(
    engine: Engine,
    messages: list[ChatMessage],
    options: ChatTemplateOptions,
    *,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt token ids of `messages`. Their size is checked before rendering (no
    rendered chat is smaller than its contents), and a big chat is rendered and
    tokenized off the event loop."""
    plain = [_plain(m) for m in messages]
    size = chat_size(messages)
    if size > engine.max_prompt_bytes:
        raise InvalidRequest(
            f"the messages hold {size} characters; the limit (max_prompt_bytes) is "
            f"{engine.max_prompt_bytes} bytes"
        )
    variables = _checked(options, plain)
    size += len(json.dumps(tools)) if tools else 0  # the template renders them too
    # A generation prompt would open a new turn after the one to continue.
    opens_turn = options.add_generation_prompt and not options.continue_final_message
    if engine.loaded.chat_template is not None:
        text = await engine.run_off_loop(
            size,
            lambda: engine.loaded.render_chat(
                plain, add_generation_prompt=opens_turn, tools=tools, **variables
            ),
        )
    else:
        text = f"tools: {json.dumps(tools)}\n" if tools else ""
        text += "".join(f"{m['role']}: {m['content']}\n" for m in plain)
        text += "assistant:" if opens_turn else ""
    if options.continue_final_message:
        text = _cut_after_final(text, plain[-1]["content"])
    # A rendered chat holds its special tokens itself.
    special = engine.loaded.chat_template is None
    return await engine.encode_text(text, add_special_tokens=special, field="messages")


def chat_size(messages: list[ChatMessage]) -> int:
    """What `max_prompt_bytes` counts of a chat: its texts' characters (at most their
    UTF-8 bytes), before any rendering."""
    return sum(len(message.text) for message in messages)


def _plain(message: ChatMessage) -> dict[str, Any]:
    """A message as the template reads it: its text, and the arguments of the tool
    calls an assistant message made as objects (templates format them; the API sends
    them as JSON text), as vLLM passes them."""
    plain = {**message.model_dump(exclude_none=True), "content": message.text}
    calls = plain.get("tool_calls")
    if isinstance(calls, list):
        plain["tool_calls"] = [_parsed_arguments(call) for call in calls]
    return plain


def _parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call  # the template gets the text as it came
    return {**call, "function": {**function, "arguments": parsed}}  # type: ignore[dict-item]


def _checked(options: ChatTemplateOptions, plain: list[dict[str, Any]]) -> dict[str, Any]:
    """The template variables `options` adds, once its rules hold (400s naming them)."""
    if options.continue_final_message:
        if "add_generation_prompt" in options.model_fields_set and options.add_generation_prompt:
            raise ApiError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        if plain[-1]["role"] != "assistant":
            raise ApiError(
                400,
                "continue_final_message needs a final assistant message",
                param="continue_final_message",
            )
    variables = options.chat_template_kwargs or {}
    reserved = sorted(RESERVED_VARIABLES & set(variables))
    if reserved:
        raise ApiError(
            400, f"chat_template_kwargs may not set {reserved[0]}", param="chat_template_kwargs"
        )
    return variables


def _cut_after_final(text: str, final: str) -> str:
    """`text` up to the end of the final message's content (transformers' rule for
    `continue_final_message`: what the template adds after it is dropped)."""
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise ApiError(
            400,
            "continue_final_message: the chat template does not show the final message's text",
            param="continue_final_message",
        )
    return text[: at + len(final.strip())]
