"""A loaded model: what every checkpoint format's reader returns (`LoadedModel`: the
decoder, its tokenizer, its config, its chat template and generation defaults), and the
dtype a model is served in (`resolve_dtype`); a chat rendered with a tokenizer's special
tokens (`chat_text`, also for clients that hold only the tokenizer: `loader.tokenizer_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from .chat import ChatTemplateError, render_chat, special_tokens
from .config import ModelConfig
from .errors import ModelLoadError
from .llama import LlamaModel
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen(kw_only=True)
class LoadedModel:
    name: str
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    chat_template: str | None = None
    generation_defaults: dict[str, Any] = attrs.field(factory=dict)
    #: False for a checkpoint without an output head (an embedding model's decoder):
    #: it answers embeddings only.
    generates: bool = True
    #: Why this model's embeddings would not be kvscope's (the last token's hidden
    #: state, normalized), as its sentence-transformers modules say; None if they are.
    embeddings_differ: str | None = None

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The chat as the model's template renders it, with its special tokens."""
        if self.chat_template is None:
            raise ChatTemplateError(f"model {self.name!r} has no chat template")
        return chat_text(
            self.chat_template,
            self.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """The token ids of the rendered chat (its special tokens come from the template)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.tokenizer.encode(text, add_special_tokens=False)


def chat_text(
    template: str,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """The chat as `template` renders it, with `tokenizer`'s special tokens."""
    tokens = special_tokens(getattr(tokenizer, "config", {}))
    return render_chat(
        template, messages, add_generation_prompt=add_generation_prompt, **{**tokens, **extra}
    )


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = checkpoint_dtype or "float32"
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use auto, float32 or bfloat16")
    return DTYPES[dtype]
