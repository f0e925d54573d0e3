"""Structured output: a request's tokens constrained by a grammar, with llguidance.

`GuideCompiler` (one per engine) owns llguidance's view of the model's tokenizer (built
on first use) and turns a request's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` (Lark, or GBNF converted to it) into a compiled matcher; one over the
budget, or that cannot compile, is a `ValueError` naming the field (a 400 on the web):
a grammar that would overflow the native compiler's stack never reaches it, and the
compile runs in a thread of its own (kernels/guide_limits.py). `Guide` is one request's
matcher, a copy of the compiled one. The model step's worker thread asks it for the mask
of the tokens allowed next (kernels/sampling.py applies it before sampling) and tells
it the token drawn, so the event loop never computes a mask. A request drops its guide
when it ends, however it ends (`RequestState.mark_ended`); `live_guides()` counts the
matchers still alive.

Why llguidance rather than xgrammar: its wheel is one abi3 binary with no Python
dependencies (MIT) and installs against any torch, where xgrammar's builds track torch
and transformers versions; it computes each mask lazily from an Earley parser, so a new
schema compiles in about a millisecond instead of precomputing a per-grammar cache; it
takes JSON Schema, regexes and Lark grammars through one matcher API.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from typing import Any

import torch

from kvscope.errors import InvalidRequest
from kvscope.kernels.guide_limits import check_budget, compile_isolated, parser_limits
from kvscope.params import SamplingParams

#: Grammars compiled, by their source (a service sees the same schemas again and again).
CACHE_SIZE = 128
#: JSON without free whitespace between tokens: a small model cannot pad its output
#: with newlines until it runs out of tokens.
JSON_OPTIONS: Any = {"whitespace_flexible": False}

#: Where a JSON schema holds more schemas: keywords whose value is a schema or a list
#: of them, and keywords whose value maps names to schemas.
_SUBSCHEMAS = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
    "additionalItems", "unevaluatedItems", "not", "if", "then", "else", "items",
    "prefixItems", "allOf", "anyOf", "oneOf",
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

_live: weakref.WeakSet[Guide] = weakref.WeakSet()


def closed_objects(source: str) -> str:
    """`source`, a JSON schema, with `additionalProperties: false` in each object
    schema that lists its properties and says nothing of others: vLLM's default (its
    xgrammar backend's strict mode; its guidance backend's rewrite is this one), so an
    answer holds only the keys the schema names. Walked without recursion: the budget
    admits schemas deeper than Python's stack."""
    schema = json.loads(source)
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending += node
            continue
        if not isinstance(node, dict):
            continue
        pending += [node.get(key) for key in _SUBSCHEMAS]
        pending += [sub for key in _SCHEMA_MAPS if isinstance(node.get(key), dict)
                    for sub in node[key].values()]  # fmt: skip
        named = isinstance(node.get("properties"), dict) or isinstance(
            node.get("patternProperties"), dict
        )
        if named and "additionalProperties" not in node:
            node["additionalProperties"] = False
    return json.dumps(schema)


def live_guides() -> int:
    """Matchers (request grammar states) alive in this process."""
    return len(_live)


class Guide:
    """One request's grammar state. Used by one thread at a time: the step's worker while
    the request is in a step, the event loop between steps."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        _live.add(self)

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        """A bool mask over the logits' columns of the tokens allowed next."""
        if self._matcher.is_error():
            return None  # `error` ends the request at delivery
        allowed = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = allowed[:vocab_size] != 0
        if allowed.numel() < vocab_size:  # the model's padding rows are never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(vocab_size - allowed.numel())])
        return allowed

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class GuideCompiler:
    """Grammars for one model's tokenizer. Each compiles once (kernels/guide_limits.py:
    within the budget, in a thread of its own) into a matcher that requests copy."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        # A failure is cached as well: a grammar over the budget is refused at once again.
        self._compile = functools.lru_cache(maxsize=CACHE_SIZE)(self._compile_uncached)

    def check(self, params: SamplingParams) -> None:
        """`InvalidRequest` about the guide's field if the request's grammar cannot
        compile."""
        if params.guided:
            self._template(params)

    def guide(self, params: SamplingParams) -> Guide | None:
        """A fresh matcher for the request (each of `n` samples gets its own): a copy of
        the compiled one, so nothing is compiled again outside the compile thread."""
        if not params.guided:
            return None
        return Guide(self._template(params).deep_copy(), self._vocab)

    def _template(self, params: SamplingParams) -> Any:
        """The request's compiled matcher, never advanced: an `InvalidRequest` about the
        guide's field if none."""
        if params.guided_json is not None:
            field, source = "guided_json", params.guided_json
        elif params.guided_regex is not None:
            field, source = "guided_regex", params.guided_regex
        elif params.guided_grammar is not None:
            field, source = "guided_grammar", params.guided_grammar
        else:
            field, source = "guided_choice", json.dumps(params.guided_choice)
        compiled = self._compile(field, source)
        if isinstance(compiled, str):
            raise InvalidRequest(compiled, field=field)
        return compiled

    def _compile_uncached(self, field: str, source: str) -> Any:
        """The compiled matcher, or the error message that says why there is none."""
        try:
            check_budget(field, source)
            return compile_isolated(lambda: self._matcher(field, source), field)
        except ValueError as exc:
            return str(exc)

    def _matcher(self, field: str, source: str) -> Any:
        """(compile thread) A matcher for `source`, its first mask computed (the lexer
        it builds is shared with its copies, so their first step is quick)."""
        try:
            import llguidance
        except ImportError:  # pragma: no cover - a core dependency
            raise ValueError(f"{field} needs the llguidance package") from None
        matcher = llguidance.LLMatcher
        try:
            if field == "guided_json":
                grammar = matcher.grammar_from_json_schema(
                    closed_objects(source), defaults=JSON_OPTIONS
                )
            elif field == "guided_regex":
                grammar = matcher.grammar_from_regex(source)
            elif field == "guided_grammar":
                grammar = matcher.grammar_from_lark(_lark(source))
            else:
                choices = " | ".join(json.dumps(choice) for choice in json.loads(source))
                grammar = matcher.grammar_from_lark(f"start: {choices}")
        except ValueError as exc:
            raise ValueError(f"{field} cannot be compiled: {exc}") from None
        tokenizer, limits = self._llg_tokenizer(), parser_limits()
        error = matcher.validate_grammar(grammar, tokenizer, limits=limits)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{field} cannot be compiled: {error.strip()}")
        compiled = matcher(tokenizer, grammar, limits=limits)
        compiled.compute_logit_bias()
        if compiled.is_error():
            raise ValueError(f"{field} cannot be compiled: {compiled.get_error().strip()}")
        return compiled

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self._tokenizer, self._vocab)
            return self._ll_tokenizer


def _lark(grammar: str) -> str:
    """A grammar as Lark: GBNF (`root ::= ...`, vLLM's and llama.cpp's) converted by
    llguidance's own converter, Lark as it is."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return str(gbnf_to_lark(grammar))
    except Exception as exc:  # the converter raises what its parser does
        raise ValueError(f"not a GBNF grammar: {exc}") from None


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's tokenizer for a Hugging Face tokenizer (its tokenizer.json) or for
    the byte tokenizer of `tiny-random` (one token per byte, then BOS and EOS)."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    eos = list(tokenizer.eos_token_ids)
    if hasattr(tokenizer, "to_json"):
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)

    class _Bytes:
        eos_token_id = eos[0]
        bos_token_id = tokenizer.bos_token_id
        tokens = [bytes([i]) for i in range(256)] + [
            b"<special>" for _ in range(256, tokenizer.vocab_size)
        ]
        special_token_ids = list(range(256, tokenizer.vocab_size))

        def __call__(self, text: bytes | str) -> list[int]:
            return list(text if isinstance(text, bytes) else text.encode("utf-8"))

    return llguidance.LLTokenizer(TokenizerWrapper(_Bytes()))
