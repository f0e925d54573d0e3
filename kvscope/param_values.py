"""How the list and text fields of a request's `SamplingParams` are read and checked:
converters (a string or a list as a tuple, a JSON schema as canonical text) and the
attrs validators that raise the `InvalidRequest` (a ValueError) carrying the field (`kvscope.params` owns
the fields; this module their values' rules).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs

from kvscope.errors import InvalidRequest
from kvscope.text import utf8_size


def strings(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def ints(value: Iterable[int] | None) -> tuple[int, ...]:
    return tuple(value) if value is not None else ()


#: Most stop strings a request may give, and the longest (in characters): each one is
#: searched for after every token, so together they bound a request's cost per token.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


def non_empty_strings(_inst: object, attribute: attrs.Attribute, value: tuple) -> None:
    for item in value:
        if not isinstance(item, str) or not item:
            raise InvalidRequest(
                f"{attribute.name} must hold non-empty strings", field=attribute.name
            )
        utf8_size(item, attribute.name, field=attribute.name)


def non_empty_ids(inst: object, attribute: attrs.Attribute, value: tuple) -> None:
    if not value:
        raise InvalidRequest(
            f"{attribute.name} must hold at least one token id", field=attribute.name
        )
    non_negative_ints(inst, attribute, value)


def stop_strings(inst: object, attribute: attrs.Attribute, value: tuple) -> None:
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"{attribute.name} may hold at most {MAX_STOP_STRINGS} strings", field=attribute.name
        )
    non_empty_strings(inst, attribute, value)
    if any(len(item) > MAX_STOP_LENGTH for item in value):
        raise InvalidRequest(
            f"{attribute.name} strings may be at most {MAX_STOP_LENGTH} characters long",
            field=attribute.name,
        )


def non_negative_ints(_inst: object, attribute: attrs.Attribute, value: tuple) -> None:
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise InvalidRequest(
                f"{attribute.name} must hold non-negative integers", field=attribute.name
            )


def json_text(value: Any) -> str | None:
    """A JSON schema given as an object (or as its JSON text) as compact JSON text."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _not_a_schema() from None
    if not isinstance(value, dict):
        raise _not_a_schema()
    return json.dumps(value, separators=(",", ":"))  # key order is generation order


def _not_a_schema() -> InvalidRequest:
    return InvalidRequest("guided_json must be a JSON schema (an object)", field="guided_json")
