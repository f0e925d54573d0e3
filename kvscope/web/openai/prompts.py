"""The prompts of an OpenAI call as token ids.

A completions `prompt` is text, token ids, or a batch of either (at most `MAX_BATCH`);
each becomes a list of token ids (text tokenized off the loop when big), cut to its
last `truncate_prompt_tokens` if asked. Whether a prompt and `max_tokens` fit the
model's context is the engine's to say (admission's `fit`, under the call's context
policy: `OpenAISampling.limit`).
"""

from __future__ import annotations

from kvscope import Engine

from ..errors import ApiError
from .schemas import CompletionBody, OpenAISampling

Prompt = str | list[int]
#: Most prompts (or texts to embed) in one call, OpenAI's limit for embeddings: each is
#: tokenized before any runs, on the event loop when short, so the count bounds a call's
#: time there (a 1 MiB body holds ~250,000 one-letter prompts).
MAX_BATCH = 2048


def batch(
    prompt: str | list[int] | list[str] | list[list[int]], *, param: str = "prompt"
) -> list[Prompt]:
    """One prompt (text or token ids) or a batch of them, as a list of prompts; `param`
    is the field that holds them."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise ApiError(400, f"the {param} is empty", param=param)
    check_batch(len(prompt), param)
    return list(prompt)  # type: ignore[arg-type]


def completion_prompts(body: CompletionBody) -> list[Prompt]:
    """A completions body's prompts; none given is a 400 in vLLM's words, and so are
    prompt embeddings (vLLM's `prompt_embeds`), which this server does not take."""
    if body.prompt_embeds:
        raise ApiError(400, "prompt_embeds is not supported by this server", param="prompt_embeds")
    if body.prompt is None or body.prompt == "":
        raise ApiError(
            400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    return batch(body.prompt)


def check_batch(count: int, param: str) -> None:
    """A 400 naming `param` if a call holds more than `MAX_BATCH` texts."""
    if count > MAX_BATCH:
        raise ApiError(
            400, f"{param} holds {count} texts; at most {MAX_BATCH} go in one call", param=param
        )


async def prompt_ids(
    engine: Engine, prompt: Prompt, *, add_special_tokens: bool = True, param: str = "prompt"
) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, f"the {param} is empty", param=param)
        # Valid Unicode, at most max_prompt_bytes, and tokenized off the loop when big.
        return await engine.encode_text(prompt, add_special_tokens=add_special_tokens, field=param)
    if not prompt:
        raise ApiError(400, f"the {param} is empty", param=param)
    return prompt  # the engine checks each id against the vocabulary


def truncated(ids: list[int], body: OpenAISampling) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's), its first with
    `truncation_side: right`, or all of it."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    return ids[:keep] if body.truncation_side == "right" else ids[-keep:]
