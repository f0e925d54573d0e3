"""Per-request sampling parameters: one frozen attrs class, validated on construction.

This module is the one statement of every rule about what a request may ask: each
numeric field's range is a `Bound` kept in the field's metadata (the HTTP schemas build
their constraints from it, `SamplingParams.bound`), and so are the ranges of a request's
`priority` and `timeout`. Invalid values raise `InvalidRequest` (a ValueError) whose
message starts with the field's name and whose `field` is it, so the web layer answers a
400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
from attrs import validators as v

from kvscope.errors import InvalidRequest
from kvscope.param_values import (
    ints,
    json_text,
    non_empty_ids,
    non_empty_strings,
    non_negative_ints,
    stop_strings,
    strings,
)

#: The largest count a request may give (`max_tokens`, `top_k`, `min_tokens`, a
#: priority): a signed 32-bit integer, so a JSON number never becomes a huge Python int.
INT32 = 2**31 - 1
#: The longest timeout a request may ask for, in seconds: a week.
TIMEOUT_MAX = 7 * 24 * 3600.0


@attrs.frozen
class Bound:
    """A numeric field's range, stated once: `lo <= value <= hi` (`lo < value` when
    `lo_open`), an integer when `integer`. It is the field's attrs validator, and the HTTP
    schemas read it (`constraints`) rather than restating the range."""

    lo: float
    hi: float
    lo_open: bool = False
    integer: bool = False

    def __call__(self, _inst: object, attribute: attrs.Attribute, value: object) -> None:
        self.check(attribute.name, value)

    def check(self, name: str, value: object) -> None:
        """`InvalidRequest` about `name` unless `value` is in range."""
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequest(f"{name} must be an integer", field=name)
            if value < self.lo:
                raise InvalidRequest(f"{name} must be >= {self.lo}", field=name)
            if value > self.hi:
                raise InvalidRequest(f"{name} must be <= {self.hi}", field=name)
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"{name} must be a number", field=name)
        lo_out = value < self.lo or (self.lo_open and value == self.lo)
        if value != value or value > self.hi or lo_out:
            raise InvalidRequest(
                f"{name} must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]",
                field=name,
            )

    def constraints(self) -> dict[str, float]:
        """The range as pydantic `Field` keywords (`ge`/`gt` and `le`)."""
        return {"gt" if self.lo_open else "ge": self.lo, "le": self.hi}


def _bounded(default: Any, bound: Bound, *, optional: bool = False) -> Any:
    """An attrs field checked by `bound`, which it keeps in its metadata for the schemas."""
    validator = v.optional(bound) if optional else bound
    return attrs.field(default=default, validator=validator, metadata={"bound": bound})


#: A request's priority (lower is more urgent) and timeout (seconds): not sampling, but
#: bounded here too so that every numeric rule of a request body has one statement
#: (`PRIORITY.check("priority", value)` raises the InvalidRequest about the field).
PRIORITY = Bound(-INT32, INT32, integer=True)
TIMEOUT = Bound(0.0, TIMEOUT_MAX, lo_open=True)

#: A request's `context` option, what admission does where prompt and `max_tokens`
#: overflow the context: "cap" runs it to the context's end (the Python API's and the
#: native routes' way), "refuse" is an `InvalidRequest` about `max_tokens` (OpenAI's 400).
ContextPolicy = Literal["refuse", "cap"]
#: A `max_tokens` that, capped, runs the completion to the context's end.
TO_THE_CONTEXT_END = INT32


#: Below this temperature sampling is greedy: dividing logits by less overflows them.
GREEDY_BELOW = 1e-5
#: The most alternatives `logprobs` may ask for per token, unless the engine says
#: otherwise (`EngineConfig.max_logprobs`, vLLM's `--max-logprobs` and its default;
#: OpenAI's chat API allows 20). -1 asks for the whole vocabulary (vLLM's).
MAX_LOGPROBS = 20
#: What `logprobs` and `prompt_logprobs` may say: -1 (every token) or a count, which
#: `check_vocab` holds to the engine's cap.
LOGPROBS = Bound(-1, INT32, integer=True)
#: The most tokens `logprob_token_ids` may name (vLLM's bound).
MAX_LOGPROB_TOKEN_IDS = 128
#: A `logit_bias` value is added to the token's logit; -100 bans the token, +100 forces it.
MAX_LOGIT_BIAS = 100.0
#: The seeds accepted: any signed 64-bit integer (vLLM's range, which refuses 2**63 and
#: beyond with a 400; `torch.Generator.manual_seed` takes them all).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: Presence and frequency penalties: OpenAI's range.
PENALTY = Bound(-2.0, 2.0)


def _bad_bias(message: str) -> InvalidRequest:
    return InvalidRequest(message, field="logit_bias")


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """`{token id: bias}` (ids as ints or as the decimal strings JSON keys are) as
    sorted `(id, bias)` pairs."""
    if value is None:
        return ()
    if not isinstance(value, (Mapping, list, tuple)):
        raise _bad_bias("logit_bias must map token ids to biases")
    items = value.items() if isinstance(value, Mapping) else value
    pairs = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise _bad_bias("logit_bias must map token ids to biases")
        key, bias = item
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise _bad_bias(
                f"logit_bias keys must be token ids (non-negative integers), not {key!r}"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias:
            raise _bad_bias(f"logit_bias values must be numbers, not {bias!r}")
        if abs(bias) > MAX_LOGIT_BIAS:
            raise _bad_bias(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], not {bias}"
            )
        pairs[key] = float(bias)
    return tuple(sorted(pairs.items()))


#: The structured-output fields, of which a request gives at most one.
GUIDES = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

#: The sampling fields a checkpoint's generation_config.json gives defaults for: they
#: fill in what a request leaves unset, on every route.
GENERATION_DEFAULTED = ("temperature", "top_p", "top_k", "min_p")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick each token and when to stop. `temperature=0` (or below 1e-5) is greedy."""

    max_tokens: int = _bounded(16, Bound(1, INT32, integer=True))
    temperature: float = _bounded(1.0, Bound(0.0, 100.0))
    top_p: float = _bounded(1.0, Bound(0.0, 1.0, lo_open=True))
    top_k: int = _bounded(0, Bound(0, INT32, integer=True))  # 0: off
    #: vLLM's: drop the tokens less likely than `min_p` times the most likely one
    #: (after temperature, before top-k and top-p); 0: off.
    min_p: float = _bounded(0.0, Bound(0.0, 1.0))
    # The range torch.Generator.manual_seed accepts.
    seed: int | None = _bounded(None, Bound(SEED_MIN, SEED_MAX, integer=True), optional=True)
    stop: tuple[str, ...] = attrs.field(default=(), converter=strings, validator=stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=ints, validator=non_negative_ints
    )
    ignore_eos: bool = attrs.field(default=False, validator=v.instance_of(bool))
    #: vLLM's: the text keeps the stop string (or stop token) that ended it.
    include_stop_str_in_output: bool = attrs.field(default=False, validator=v.instance_of(bool))
    #: vLLM's: special tokens (EOS, chat markers) show no text; False shows theirs.
    skip_special_tokens: bool = attrs.field(default=True, validator=v.instance_of(bool))
    # What OpenAI and vLLM add (kernels/sampling.py applies them, in vLLM's order:
    # allowed_token_ids, bias, min_tokens, the penalties, then bad_words, before
    # temperature, min_p, top-k and top-p).
    #: Log-probabilities of each chosen token and of the `logprobs` most likely
    #: alternatives (0: the chosen token's only; -1: every token's); None: none.
    logprobs: int | None = _bounded(None, LOGPROBS, optional=True)
    #: The same for each prompt token after the first, given the tokens before it
    #: (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`). Such a request
    #: computes its whole prompt: it takes no cached prefix and shares no sibling's.
    prompt_logprobs: int | None = _bounded(None, LOGPROBS, optional=True)
    #: vLLM's: with `logprobs`, each token's alternatives are these tokens (in this
    #: order) in the place of the most likely ones.
    logprob_token_ids: tuple[int, ...] | None = attrs.field(
        default=None,
        converter=attrs.converters.optional(ints),
        validator=v.optional(non_empty_ids),
    )
    presence_penalty: float = _bounded(0.0, PENALTY)
    frequency_penalty: float = _bounded(0.0, PENALTY)
    #: vLLM's (and transformers'): divides a positive logit of a token already in the
    #: prompt or the output by this, multiplies a negative one; 1 is off.
    repetition_penalty: float = _bounded(1.0, Bound(0.0, 100.0, lo_open=True))
    #: End-of-sequence and stop token ids are banned until this many tokens are out.
    min_tokens: int = _bounded(0, Bound(0, INT32, integer=True))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    #: vLLM's: words the output may not hold. The token that would complete one (as
    #: the word is spelled at the text's start, or after a space) is banned.
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=strings, validator=stop_strings)
    #: vLLM's: only these tokens may be drawn (None: any).
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None,
        converter=attrs.converters.optional(ints),
        validator=v.optional(non_empty_ids),
    )
    # Structured output (vLLM's names; kernels/guided.py): at most one of these.
    #: A JSON schema the output must match (kept as canonical JSON text).
    guided_json: str | None = attrs.field(default=None, converter=json_text)
    #: A regular expression the whole output must match.
    guided_regex: str | None = attrs.field(default=None, validator=v.optional(v.instance_of(str)))
    #: The output is exactly one of these strings.
    guided_choice: tuple[str, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(strings)
    )
    #: A grammar the whole output must match: Lark (llguidance's), or GBNF as vLLM's
    #: and llama.cpp's grammars are written (`root ::= ...`).
    guided_grammar: str | None = attrs.field(default=None, validator=v.optional(v.instance_of(str)))

    #: Generate nothing: the request's answer is its prompt's embedding, the last
    #: token's final hidden state, L2-normalized (how decoder embedding models pool:
    #: Qwen3-Embedding, e5-mistral, gte-Qwen2; OpenAI's and vLLM's /v1/embeddings).
    embed: bool = attrs.field(default=False, validator=v.instance_of(bool))
    #: The LoRA adapter the request runs with, by the name the engine loaded it under
    #: (`EngineConfig.lora_modules`); None: the base model.
    lora: str | None = attrs.field(default=None, validator=v.optional(v.instance_of(str)))

    @embed.validator
    def _embed_alone(self, _attribute: attrs.Attribute, value: bool) -> None:
        asked = [name for name in (*GUIDES, "logprobs", "prompt_logprobs") if getattr(self, name)]
        if value and asked:
            raise InvalidRequest(
                f"embed generates no token: it cannot be combined with {asked[0]}", field="embed"
            )

    @guided_choice.validator
    def _choices(self, attribute: attrs.Attribute, value: tuple[str, ...] | None) -> None:
        if value is not None:
            if not value:
                raise InvalidRequest(
                    "guided_choice must hold at least one string", field="guided_choice"
                )
            non_empty_strings(self, attribute, value)

    @guided_grammar.validator
    def _one_guide(self, _attribute: attrs.Attribute, _value: str | None) -> None:
        given = [name for name in GUIDES if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidRequest(
                f"{given[1]} cannot be combined with {given[0]}; give one guide", field=given[1]
            )

    @logprob_token_ids.validator
    def _pinned_logprobs(self, _attribute: attrs.Attribute, value: tuple[int, ...] | None) -> None:
        if value is None:
            return
        if len(value) > MAX_LOGPROB_TOKEN_IDS:
            raise InvalidRequest(
                f"logprob_token_ids may name at most {MAX_LOGPROB_TOKEN_IDS} tokens, not {len(value)}",
                field="logprob_token_ids",
            )
        if self.logprobs is None:
            raise InvalidRequest("logprob_token_ids needs logprobs", field="logprob_token_ids")

    @min_tokens.validator
    def _min_below_max(self, _attribute: attrs.Attribute, value: int) -> None:
        if value > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), not {value}",
                field="min_tokens",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Any penalty, `min_tokens` or `bad_words` set: sampling needs the tokens
        seen so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
            or bool(self.bad_words)
        )

    @property
    def guided(self) -> bool:
        return any(getattr(self, name) is not None for name in GUIDES)

    @property
    def processed(self) -> bool:
        """Anything set that changes the logits before sampling."""
        return self.penalized or bool(self.logit_bias) or self.allowed_token_ids is not None

    def check_vocab(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Token ids named here must exist in the model's vocabulary, and the
        alternatives asked for per token (-1: the vocabulary) be at most `max_logprobs`
        (-1: any number); `InvalidRequest` about the field if not."""
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(self, name)
            count = vocab_size if asked == -1 else asked
            if count is not None and -1 < max_logprobs < count:
                raise InvalidRequest(  # vLLM's words, after the field's name
                    f"{name} of {count} requested, which is greater than max allowed: "
                    f"{max_logprobs} (--max-logprobs)",
                    field=name,
                )
        for token, _bias in self.logit_bias:
            if token >= vocab_size:
                raise _bad_bias(
                    f"logit_bias token id {token} is not below the vocabulary size {vocab_size}"
                )
        for token in self.allowed_token_ids or ():
            if token >= vocab_size:
                raise InvalidRequest(
                    f"allowed_token_ids id {token} is not below the vocabulary size {vocab_size}",
                    field="allowed_token_ids",
                )
        if bad := [token for token in self.logprob_token_ids or () if token >= vocab_size]:
            raise InvalidRequest(  # vLLM's words
                f"logprob_token_ids holds token_id(s) {bad} out of vocabulary. "
                f"Vocabulary size: {vocab_size}",
                field="logprob_token_ids",
            )

    @classmethod
    def fields(cls) -> frozenset[str]:
        return frozenset(f.name for f in attrs.fields(cls))

    @classmethod
    def bound(cls, name: str) -> Bound | None:
        """The range of the numeric field `name` (None for a field with no range)."""
        return getattr(attrs.fields(cls), name).metadata.get("bound")

    @classmethod
    def default(cls, name: str) -> Any:
        return getattr(attrs.fields(cls), name).default

    @classmethod
    def bounds(cls) -> dict[str, Bound]:
        """Every numeric field's range, by name."""
        return {f.name: f.metadata["bound"] for f in attrs.fields(cls) if "bound" in f.metadata}
