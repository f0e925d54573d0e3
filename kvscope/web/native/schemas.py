"""The native API's request and response bodies, declared once.

Pydantic models: routes read bodies through `bodies.read_body` and document them with
quart-schema, so `/openapi.json` describes exactly what is validated. Inputs are strict
(no type coercion, unknown fields refused) and bounded, so a bad value is a 400 naming
the field. No range is written here: each numeric field's constraints are built from
the `Bound` that `kvscope.params` states once (`sampling_field`, `bounded_field`), the
one the engine checks again when it builds `SamplingParams`. What depends on the model
(the context, the vocabulary) is checked by the engine or the route. Every protocol's
body turns its fields into `SamplingParams` kwargs through `sampling_kwargs`: its field
declarations are its only list of them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvscope.params import MAX_LOGIT_BIAS, PRIORITY, TIMEOUT, Bound, SamplingParams

Status = Literal["queued", "running", "finished", "cancelled", "failed"]


_DEFAULT: Any = object()


def bounded_field(bound: Bound, default: Any, *, hi: float | None = None, **kwargs: Any) -> Any:
    """A pydantic `Field` constrained by `bound`; `hi` narrows its top (an API's own
    limit, such as OpenAI's temperature), never widens it."""
    constraints: dict[str, Any] = bound.constraints()
    if hi is not None:
        if hi > bound.hi:
            raise ValueError(f"a schema may narrow a range, not widen it ({hi} > {bound.hi})")
        constraints["le"] = hi
    return Field(default, **constraints, **kwargs)


def sampling_field(name: str, default: Any = _DEFAULT, **kwargs: Any) -> Any:
    """The `Field` of `SamplingParams.name` (its default unless `default` is given)."""
    bound = SamplingParams.bound(name)
    if bound is None:
        raise ValueError(f"SamplingParams.{name} has no range")
    return bounded_field(
        bound, SamplingParams.default(name) if default is _DEFAULT else default, **kwargs
    )


def sampling_kwargs(
    body: BaseModel,
    *,
    names: Mapping[str, str] | None = None,
    only_if_set: Collection[str] = (),
    derived: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `SamplingParams` keyword arguments of `body`, read from its declared fields:
    each `SamplingParams` field the body declares passes through by name (the body's
    own name for it in `names`, where it spells it otherwise); one in `only_if_set`
    only if the client set it (so the engine fills it, from the checkpoint's generation
    defaults, otherwise); `derived` (what the body computes from other fields) takes
    the place of what was read; a None value is "not given" and is left out."""
    names = names or {}
    declared = type(body).model_fields
    given = body.model_fields_set
    values: dict[str, Any] = {}
    for name in SamplingParams.fields():
        field = names.get(name, name)
        if field in declared and (name not in only_if_set or field in given):
            values[name] = getattr(body, field)
    values.update(derived or {})
    return {name: value for name, value in values.items() if value is not None}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Sampling(Strict):
    """`SamplingParams` fields, as the HTTP API takes them."""

    max_tokens: int = sampling_field("max_tokens", description="capped to what fits in the context")
    temperature: float = sampling_field("temperature", description="0 is greedy")
    top_p: float = sampling_field("top_p")
    top_k: int = sampling_field("top_k", description="0 disables top-k")
    min_p: float = sampling_field("min_p", description="vLLM's; 0 is off")
    seed: int | None = sampling_field("seed", description="any signed 64-bit integer")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = Field(None, description="vLLM's: only these")
    bad_words: list[str] | None = Field(None, description="vLLM's: words the output may not hold")
    ignore_eos: bool = SamplingParams.default("ignore_eos")
    include_stop_str_in_output: bool = SamplingParams.default("include_stop_str_in_output")
    skip_special_tokens: bool = SamplingParams.default("skip_special_tokens")
    logprobs: int | None = sampling_field(
        "logprobs", description="each token's log-probability and the top k (raw model logits)"
    )
    prompt_logprobs: int | None = sampling_field(
        "prompt_logprobs",
        description="the same for each prompt token, on the first token event (vLLM's)",
    )
    logprob_token_ids: list[int] | None = Field(
        None, description="with logprobs: these tokens' in the place of the top k (vLLM's)"
    )
    presence_penalty: float = sampling_field(
        "presence_penalty", description="subtracted once from tokens already out"
    )
    frequency_penalty: float = sampling_field(
        "frequency_penalty", description="subtracted per occurrence in the output"
    )
    repetition_penalty: float = sampling_field("repetition_penalty", description="vLLM's; 1 is off")
    min_tokens: int = sampling_field(
        "min_tokens", description="EOS and stop tokens banned until reached"
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description=f"token id (as a string) -> bias in [-{MAX_LOGIT_BIAS:g}, "
        f"{MAX_LOGIT_BIAS:g}] added to its logit",
    )
    guided_json: dict[str, Any] | None = Field(None, description="a JSON schema to match")
    guided_regex: str | None = Field(None, description="a regular expression to match")
    guided_choice: list[str] | None = Field(None, description="answer one of these strings")
    guided_grammar: str | None = Field(None, description="a Lark or GBNF grammar to match")
    embed: bool = Field(
        SamplingParams.default("embed"),
        description="answer the prompt's embedding (the request's `embedding`), generate nothing",
    )
    lora: str | None = Field(
        None, description="the LoRA adapter to run with, by its name (`--lora-modules`)"
    )

    def to_sampling_params(self) -> dict[str, Any]:
        """The `SamplingParams` keyword arguments the client gave (a field it left out
        takes the checkpoint's generation default, then `SamplingParams`' own)."""
        return sampling_kwargs(self, only_if_set=SamplingParams.fields())


#: The `SamplingParams` fields the native API takes: all of them (tests/web/test_rules.py).
SAMPLING_FIELDS = tuple(name for name in Sampling.model_fields if name in SamplingParams.fields())


class GenerateBody(Sampling):
    """`POST /generate` and the WebSocket's generate message."""

    prompt: str | None = Field(None, description="the prompt text; or give prompt_token_ids")
    prompt_token_ids: list[int] | None = Field(None, description="the prompt as token ids")
    priority: int = bounded_field(PRIORITY, 0, description="lower is more urgent")
    parent: str | None = Field(None, description="a live request id: run as its child")
    timeout: float | None = bounded_field(
        TIMEOUT, None, description="seconds; cancels with reason timeout"
    )
    stream: bool = Field(False, description="answer an SSE stream of token events instead of 202")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        return self

    def engine_prompt(self) -> str | list[int]:
        return self.prompt if self.prompt is not None else list(self.prompt_token_ids or ())


class Accepted(BaseModel):
    id: str
    status: Status


class RequestView(BaseModel):
    """One request as `GET /requests/{id}` shows it."""

    id: str
    status: Status
    text: str
    token_ids: list[int]
    tokens_generated: int
    prompt_tokens: int
    finish_reason: str | None
    cancel_reason: str | None
    cancelled_by: str | None
    parent: str | None
    children: list[str]
    priority: int
    created: float
    error: str | None = None
    #: With `embed`, once computed: the prompt's embedding.
    embedding: list[float] | None = None


class RequestList(BaseModel):
    requests: list[RequestView]


class CancelReportView(BaseModel):
    id: str
    found: bool
    status: str
    cancelled_children: int
    tokens_generated: int
    blocks_released: int
    release_seconds: float | None
    in_running_step: bool
    reply_seconds: float | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    status: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Stats(BaseModel):
    """`Engine.stats()` and the server's counters (tests/web/test_observability.py
    holds the two to the same keys)."""

    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_in_use: int
    kv_blocks_cached: int
    running: int
    waiting: int
    live_requests: int
    finished: int
    cancelled: int
    failed: int
    steps: int
    prompt_tokens_admitted: int = Field(description="prompt tokens of admitted requests")
    prompt_tokens_reused: int = Field(
        description="of them, found computed (the prefix cache or a parent's blocks)"
    )
    tasks: int = Field(description="request tasks running now: 0 when nothing leaked")
    worker_pid: int = Field(description="the model worker process (0 with worker=thread)")
    worker_restarts: int
    warm_up_pending: int = Field(
        description="row buckets the thread worker's idle warm-up has still to build"
        " (0 once done, and with worker=process)"
    )
    model_bytes: int = Field(
        description="the memory this process's copy of the model holds (0 once a model worker"
        " process has taken over)"
    )
    history: int = Field(description="ended requests kept for look-up by id")
    history_bytes: int
    tokens_generated_total: int
    spec_decode_num_drafts: int = Field(
        description="speculative decoding: drafts verified (docs/speculative.md)"
    )
    spec_decode_num_draft_tokens: int = Field(description="their tokens")
    spec_decode_num_accepted_tokens: int = Field(description="of them, accepted")
    open_streams: int
    readiness: Literal["warming", "ready"] = Field(
        description="ready once the server serves at full speed (GET /ready)"
    )
    warming: list[str] = Field(
        description="what it still waits for: kernel build, model worker, warm-up"
    )


class Readiness(BaseModel):
    readiness: Literal["warming", "ready"]
    warming: list[str]


class Health(BaseModel):
    status: Literal["ok", "shutting_down"]
    ready: bool
    model: str


def request_view(info_dict: dict[str, Any]) -> dict[str, Any]:
    """A `RequestInfo.as_dict()` as the API shows it (the owner stays private)."""
    return {k: v for k, v in info_dict.items() if k != "owner"}
