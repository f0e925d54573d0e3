"""OpenAI-compatible request bodies (`/v1/completions`, `/v1/chat/completions`).

Lenient where OpenAI's clients are: unknown fields (`user`, `logit_bias`, ...) are
accepted and ignored, as vLLM does; the fields kvscope acts on are validated and
bounded. `top_k`, `ignore_eos`, `stop_token_ids` and `priority` are the usual vLLM
extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .schemas import INT32, SEED_MAX

MAX_N = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class OpenAISampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX - MAX_N)
    top_k: int = Field(0, ge=0, le=INT32)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = Field(0, ge=-INT32, le=INT32)

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        """`SamplingParams` kwargs (for sample 0; the engine seeds sample i with seed + i)."""
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop is not None:
            params["stop"] = self.stop
        if self.stop_token_ids is not None:
            params["stop_token_ids"] = self.stop_token_ids
        if self.seed is not None:
            params["seed"] = self.seed
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(OpenAISampling):
    """`POST /v1/completions`: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(OpenAISampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
