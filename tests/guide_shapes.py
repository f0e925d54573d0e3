"""Guides shaped to overflow a native grammar compiler's stack (kernels/guide_limits.py),
for the budget's unit tests and the guided routes' crash tests."""

from __future__ import annotations

import json
from typing import Any


def lark_chain(rules: int) -> str:
    """`r0: "x0" r1 | "y"`, `r1: ...`: `rules` rules, each one level deeper."""
    chain = "\n".join(f'r{i}: "x{i}" r{i + 1} | "y"' for i in range(rules))
    return f'start: r0\n{chain}\nr{rules}: "z"\n'


def schema_ref_chain(links: int) -> dict[str, Any]:
    """A JSON schema of `links` `$defs`, each an object whose property `$ref`s the next."""
    defs: dict[str, Any] = {
        f"d{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["x"],
        }
        for i in range(links)
    }
    defs[f"d{links}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_parens_grammar(depth: int) -> str:
    return "start: " + "(" * depth + '"a"' + ")" * depth


def nested_regex(depth: int) -> str:
    return "(" * depth + "a" + ")" * depth


def nested_array_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    return schema


def as_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"))
