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


def chat_prompt(engine: Engine, messages: list[ChatMessage]) -> list[int]:
    plain = [{**m.model_dump(exclude_none=True), "content": _text(m.content)} for m in messages]
    if engine.loaded.chat_template is not None:
        return engine.loaded.encode_chat(plain)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
    return engine.tokenizer.encode(text)
