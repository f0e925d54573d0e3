"""The option objects an OpenAI body holds (`/v1/completions`, `/v1/chat/completions`):
`stream_options`, `response_format` (with its `json_schema`) and vLLM's
`structured_outputs`. Like the bodies (`schemas`), each refuses a field it does
not declare.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # always strict here: the grammar enforces the schema


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its newer spelling of the `guided_*` fields): one
    of a JSON schema, a regex, choices or a grammar."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def guides(self) -> dict[str, Any]:
        """As `SamplingParams`' `guided_*` fields."""
        given = {
            "guided_json": self.json_,
            "guided_regex": self.regex,
            "guided_choice": self.choice,
            "guided_grammar": self.grammar,
        }
        return {name: value for name, value in given.items() if value is not None}


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`; `json_object` is any JSON object."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def guide_schema(self) -> dict[str, Any] | None:
        """The JSON schema to constrain to (None for text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_ if self.json_schema is not None else None
        return None
