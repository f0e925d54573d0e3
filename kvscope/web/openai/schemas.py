"""OpenAI-compatible request bodies: the sampling fields `/v1/completions` and the chat
routes share, and `/v1/completions`' body (the chat bodies are `chat_schemas`').

Refused, never ignored: a field that is not declared here is a 400 naming it (a field
that changes the output and is silently dropped is a wrong answer that looks right).
Fields with no effect on the output (`user`, `metadata`, `store`, `service_tier`) are
declared and ignored. Declared fields kvscope cannot honour in every value (`best_of`,
`tool_choice`, `response_format`) are checked by the route, which names them in its
400. `top_k`, `ignore_eos`, `stop_token_ids`, `min_tokens`, `repetition_penalty`,
`priority` and the others docs/openai.md lists are vLLM's extensions. Numeric ranges are
built from the `Bound`s of `kvscope.params` (`sampling_field`), never restated; the
only limits of this module's own are OpenAI's: `temperature` up to 2 (a narrowing of
`SamplingParams`' range) and `n` (and `best_of`) up to `MAX_N`. The option objects
a body holds (`stream_options`, `response_format`, ...) are `options`'.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvscope.beam_search import MAX_BEAM_WIDTH
from kvscope.params import (
    GENERATION_DEFAULTED,
    MAX_LOGIT_BIAS,
    PRIORITY,
    TO_THE_CONTEXT_END,
    ContextPolicy,
    SamplingParams,
)

from ..native.schemas import bounded_field, sampling_field, sampling_kwargs
from .options import ResponseFormat, StreamOptions, StructuredOutputs

#: OpenAI's limits, narrower than what `SamplingParams` allows.
MAX_N = 16
MAX_TEMPERATURE = 2.0


#: The fields beam search would not apply (vLLM drops them): refused with it unless
#: left at their defaults. It applies `n` (the width), `max_tokens`, `temperature` (a
#: drawn token joins a step's candidates), `ignore_eos`, `include_stop_str_in_output`,
#: `skip_special_tokens`, `length_penalty`, `priority` and the adapter `model` names.
BEAM_SEARCH_REFUSES = (
    "stream",
    "stream_options",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "logprob_token_ids",
    "echo",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tools",
    "tool_choice",
)


class OpenAISampling(BaseModel):
    """Fields both routes take. Any other field is refused with a 400 naming it (for
    example `suffix`, `functions`, `modalities`); `best_of` above
    1 is refused too. `user`, `metadata`, `store` and `service_tier` have no effect
    on the output and are accepted. Log-probabilities are the model's raw ones
    (before penalties, bias, grammar, temperature, top-k and top-p), as vLLM's
    default."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    #: The body's names of `SamplingParams` fields it spells otherwise (its 400s name them).
    ENGINE_NAMES: ClassVar[dict[str, str]] = {}
    #: `max_tokens` where the client gives none (capped by the engine to what fits).
    DEFAULT_MAX_TOKENS: ClassVar[int] = TO_THE_CONTEXT_END

    model: str | None = None
    max_tokens: int | None = sampling_field("max_tokens", None)
    temperature: float = sampling_field("temperature", hi=MAX_TEMPERATURE)
    top_p: float = sampling_field("top_p")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    stop: str | list[str] | None = None
    seed: int | None = sampling_field("seed", description="any signed 64-bit integer")
    presence_penalty: float = sampling_field("presence_penalty")
    frequency_penalty: float = sampling_field("frequency_penalty")
    logit_bias: dict[str, float] | None = Field(
        None,
        description=f"token id (a string) -> bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; "
        f"-{MAX_LOGIT_BIAS:g} bans the token",
    )
    top_k: int = sampling_field("top_k")
    min_p: float = sampling_field("min_p", description="vLLM's; 0 is off")
    ignore_eos: bool = SamplingParams.default("ignore_eos")
    include_stop_str_in_output: bool = SamplingParams.default("include_stop_str_in_output")
    skip_special_tokens: bool = SamplingParams.default("skip_special_tokens")
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = Field(None, description="vLLM's: only these")
    bad_words: list[str] | None = Field(None, description="vLLM's: words the output may not hold")
    min_tokens: int = sampling_field("min_tokens")
    repetition_penalty: float = sampling_field("repetition_penalty")
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="vLLM's: keep only the prompt's last k tokens"
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="vLLM's, with truncate_prompt_tokens: right keeps the first k"
    )
    prompt_logprobs: int | None = sampling_field(
        "prompt_logprobs", description="vLLM's: each prompt token's and the top k; not streamed"
    )
    logprob_token_ids: list[int] | None = Field(
        None, description="vLLM's, with logprobs: these tokens' in the place of the top k"
    )
    priority: int = bounded_field(PRIORITY, 0)
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema: constrained decoding"
    )
    guided_json: dict[str, Any] | None = Field(None, description="vLLM's: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM's: a regular expression")
    guided_choice: list[str] | None = Field(None, description="vLLM's: one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM's: a Lark or GBNF grammar")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: json, regex, choice or grammar"
    )
    use_beam_search: bool = Field(
        False, description=f"vLLM's: the n (up to {MAX_BEAM_WIDTH}) best beams; not streamed"
    )
    length_penalty: float = Field(
        1.0, description="vLLM's, with use_beam_search: beams rank by logprob / length ** this"
    )
    return_token_ids: bool | None = Field(
        None, description="vLLM's: prompt_token_ids, and each choice's token_ids"
    )
    return_tokens_as_token_ids: bool | None = Field(
        None,
        description="vLLM's: logprobs show each token as token_id:N (default: the "
        "server's --return-tokens-as-token-ids)",
    )
    # No effect on the output: accepted and ignored.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @property
    def asked_max_tokens(self) -> int | None:
        """The completion's length the client asked for, if it did."""
        return self.max_tokens

    @property
    def limit(self) -> tuple[int, ContextPolicy]:
        """The `max_tokens` the engine is asked for and its context policy: the client's
        own is refused where the prompt leaves it no room (OpenAI's 400, as vLLM's); the
        default (`DEFAULT_MAX_TOKENS`) is capped to what fits."""
        asked = self.asked_max_tokens
        return (self.DEFAULT_MAX_TOKENS, "cap") if asked is None else (asked, "refuse")

    def engine_names(self) -> dict[str, str]:
        """The body's names of the engine's fields where they differ (`ENGINE_NAMES`)."""
        return dict(self.ENGINE_NAMES)

    def to_sampling_params(self, max_tokens: int) -> dict[str, Any]:
        """`SamplingParams` kwargs (for sample 0; the engine seeds sample i with seed + i):
        each declared `SamplingParams` field by name (`engine_names` where the body spells
        it otherwise), then what `derived_sampling` computes. A field with a checkpoint
        generation default (`generation_config.json`) goes only if the client set it, so
        the engine fills it from the checkpoint otherwise, as vLLM and the native routes
        do."""
        return sampling_kwargs(
            self,
            names=self.engine_names(),
            only_if_set=GENERATION_DEFAULTED,
            derived=self.derived_sampling(max_tokens),
        )

    def derived_sampling(self, max_tokens: int) -> dict[str, Any]:
        """The `SamplingParams` kwargs computed from more than their own field (None: not
        given): the length the route settled, the log-probabilities asked, the guide of
        `response_format` or `structured_outputs`."""
        derived: dict[str, Any] = {
            "max_tokens": max_tokens,
            "logprobs": self.logprobs_wanted,
            "prompt_logprobs": self.prompt_logprobs_wanted,
            "logprob_token_ids": self.logprob_token_ids or None,  # [] asks for none (vLLM's)
        }
        schema = self.response_format.guide_schema() if self.response_format else None
        if schema is not None:  # a text format leaves a guided_json given beside it
            derived["guided_json"] = schema
        if self.structured_outputs is not None:
            derived.update(self.structured_outputs.guides())
        return derived

    def beam_search_refusal(self) -> tuple[str, str] | None:
        """With `use_beam_search`, why the body cannot be searched and the field to
        name (None if it can): beam search is not streamed, and draws with none of the
        sampling fields (a field it would drop must not be sent)."""
        if not self.use_beam_search:
            return None
        if self.n > MAX_BEAM_WIDTH:
            return f"use_beam_search takes n of at most {MAX_BEAM_WIDTH} (the beam width)", "n"
        for name in BEAM_SEARCH_REFUSES:
            field = type(self).model_fields.get(name)
            if field is not None and getattr(self, name) != field.default:
                return f"{name} is not applied with use_beam_search", name
        return None

    @property
    def guide_fields(self) -> list[str]:
        """The fields the client constrained the output with (at most one may be)."""
        named = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        given = [name for name in named if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if self.structured_outputs is not None:
            guides = self.structured_outputs.guides()
            given += [f"structured_outputs.{name.removeprefix('guided_')}" for name in guides]
        return given

    @property
    def json_output(self) -> bool:
        """The output is constrained to JSON (a schema, `json_object`)."""
        fmt = self.response_format
        structured = self.structured_outputs
        return (
            self.guided_json is not None
            or (fmt is not None and fmt.type != "text")
            or (structured is not None and structured.json_ is not None)
        )

    @property
    def logprobs_wanted(self) -> int | None:
        """How many alternatives per token to report (None: no logprobs)."""
        return None

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """How many alternatives per prompt token to report (None: the prompt's are
        not scored)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Each chunk's usage (vLLM's rule: only with `include_usage` too)."""
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)


class CompletionBody(OpenAISampling):
    """`POST /v1/completions`: a prompt as text or token ids, or a batch of them."""

    #: OpenAI's default (chat's is what fits).
    DEFAULT_MAX_TOKENS: ClassVar[int] = 16

    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    prompt_embeds: str | list[Any] | None = Field(
        None, description="vLLM's: refused unless empty (prompts are text or token ids here)"
    )
    echo: bool = Field(False, description="the prompt's text before the completion's")
    add_special_tokens: bool = Field(True, description="vLLM's: the BOS a text prompt gets")
    logprobs: int | None = sampling_field(
        "logprobs", description="log-probabilities of the top k per token"
    )
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only 1 (or unset)")

    @property
    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """`prompt_logprobs`, or `echo` with `logprobs` (the echoed prompt's tokens are
        scored too); the more alternatives of the two."""
        echoed = self.logprobs if self.echo else None
        asked = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(asked, key=lambda k: math.inf if k == -1 else k) if asked else None  # -1: all
