"""Per-request sampling parameters: one frozen attrs class, validated on construction.

Invalid values raise `ValueError` naming the field, so the web layer can answer 400.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
from attrs import validators as v

from kvscope.text import utf8_size


def _strings(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _ints(value: Iterable[int] | None) -> tuple[int, ...]:
    return tuple(value) if value is not None else ()


#: Most stop strings a request may give, and the longest (in characters): each one is
#: searched for after every token, so together they bound a request's cost per token.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


def _stop_strings(_inst: object, attribute: attrs.Attribute, value: tuple) -> None:
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"{attribute.name} may hold at most {MAX_STOP_STRINGS} strings")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{attribute.name} must hold non-empty strings")
        if len(item) > MAX_STOP_LENGTH:
            raise ValueError(
                f"{attribute.name} strings may be at most {MAX_STOP_LENGTH} characters long"
            )
        utf8_size(item, attribute.name)


def _non_negative_ints(_inst: object, attribute: attrs.Attribute, value: tuple) -> None:
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ValueError(f"{attribute.name} must hold non-negative integers")


def _number(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[Any, Any, Any], None]:
    def check(_inst: object, attribute: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{attribute.name} must be a number")
        if value != value or value > hi or value < lo or (lo_open and value == lo):
            bound = "(" if lo_open else "["
            raise ValueError(f"{attribute.name} must be in {bound}{lo}, {hi}]")

    return check


def _int_at_least(lo: int, hi: int | None = None) -> Callable[[Any, Any, Any], None]:
    def check(_inst: object, attribute: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{attribute.name} must be an integer")
        if value < lo:
            raise ValueError(f"{attribute.name} must be >= {lo}")
        if hi is not None and value > hi:
            raise ValueError(f"{attribute.name} must be <= {hi}")

    return check


#: Below this temperature sampling is greedy: dividing logits by less overflows them.
GREEDY_BELOW = 1e-5


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick each token and when to stop. `temperature=0` (or below 1e-5) is greedy."""

    max_tokens: int = attrs.field(default=16, validator=_int_at_least(1))
    temperature: float = attrs.field(default=1.0, validator=_number(0.0, 100.0))
    top_p: float = attrs.field(default=1.0, validator=_number(0.0, 1.0, lo_open=True))
    top_k: int = attrs.field(default=0, validator=_int_at_least(0))
    # The range torch.Generator.manual_seed accepts.
    seed: int | None = attrs.field(
        default=None, validator=v.optional(_int_at_least(-(2**63), 2**64 - 1))
    )
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strings, validator=_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_ints, validator=_non_negative_ints
    )
    ignore_eos: bool = attrs.field(default=False, validator=v.instance_of(bool))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def fields(cls) -> frozenset[str]:
        return frozenset(f.name for f in attrs.fields(cls))
