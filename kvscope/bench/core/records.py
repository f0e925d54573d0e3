"""Typed result records: attrs classes that turn into JSON and back.

Every figure a benchmark writes is a field of a frozen attrs class deriving from
`Record`. `as_dict()` gives plain JSON types (tuples become lists); `from_dict(data)`
builds the record back from its annotations (nested records, `list[X]`, `tuple[X, ...]`,
`dict[str, X]`, `X | None`). Reading is strict: a key the record has no field for is an
error, so a renamed or dropped field cannot pass silently; a field missing from the data
takes its default (the newer fields all have one, so older files still load).

`FORMAT` is the version of the files written now; files without `format` are version 1
(the untyped dicts before the split), which differ only where a reader says so.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Self

import attr
import attrs

#: The version of the JSON files the benchmarks write now.
FORMAT = 2


class Record:
    """Mixin for attrs classes: `as_dict()`, `from_dict()`, `to_json()`."""

    def as_dict(self) -> dict[str, Any]:
        # attr.asdict turns tuples into lists (attrs.asdict keeps them).
        return attr.asdict(self, retain_collection_types=False)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return structure(cls, data)

    def to_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2))


def structure(cls: type, data: dict[str, Any]) -> Any:
    """An instance of the attrs class `cls` from `data` (see the module docstring)."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} needs an object, not {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in attrs.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}")
    return cls(**{k: _value(hints[k], v) for k, v in data.items()})


def _value(tp: Any, value: Any) -> Any:
    if value is None or tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in args if a is not type(None)]
        # A union of scalars (float | int | str) is kept as JSON gave it.
        return _value(options[0], value) if len(options) == 1 else value
    if isinstance(tp, type) and attrs.has(tp):
        return structure(tp, value)
    if origin is list:
        return [_value(args[0], v) for v in value]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v) for v in value)
        return tuple(_value(a, v) for a, v in zip(args, value, strict=True))
    if origin is dict:
        return {k: _value(args[1], v) for k, v in value.items()}
    return value


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a benchmark result (a JSON object)")
    return data
