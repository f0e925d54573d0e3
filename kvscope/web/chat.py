"""Turning OpenAI chat messages into prompt token ids.

A model with a chat template renders it (`LoadedModel.encode_chat`, exactly as
transformers would); one without (such as `tiny-random`) gets a plain fallback:
`role: content` lines, then `assistant:`. Content given as a list of parts keeps its
text parts.
"""

from __future__ import annotations

from typing import Any

from kvscope import Engine, InvalidRequest

from .openai_schemas import ChatMessage


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequest("only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


async def chat_prompt(engine: Engine, messages: list[ChatMessage]) -> list[int]:
    """The prompt token ids of `messages`. Their size is checked before rendering (no
    rendered chat is smaller than its contents), and a big chat is rendered and
    tokenized off the event loop."""
    plain = [{**m.model_dump(exclude_none=True), "content": _text(m.content)} for m in messages]
    size = sum(len(m["content"]) for m in plain)  # characters: at most its UTF-8 bytes
    if size > engine.max_prompt_bytes:
        raise InvalidRequest(
            f"the messages hold {size} characters; the limit (max_prompt_bytes) is "
            f"{engine.max_prompt_bytes} bytes"
        )
    if engine.loaded.chat_template is not None:
        text = await engine.run_off_loop(size, lambda: engine.loaded.render_chat(plain))
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
    # A rendered chat holds its special tokens itself.
    special = engine.loaded.chat_template is None
    return await engine.encode_text(text, add_special_tokens=special, what="the messages")
