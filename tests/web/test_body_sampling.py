"""Each request body's `SamplingParams` fields reach the engine: a body's field list is
its only one (`sampling_kwargs` reads them by name), so a field declared on a body under
a `SamplingParams` name and set by the client is in the kwargs, with its value."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from kvscope.params import SamplingParams
from kvscope.web.native.schemas import GenerateBody
from kvscope.web.openai.chat_schemas import BatchChatBody, ChatBody
from kvscope.web.openai.responses.schemas import ResponsesBody
from kvscope.web.openai.schemas import CompletionBody, OpenAISampling

#: A value other than the default for each `SamplingParams` field.
SAMPLES: dict[str, Any] = {
    "max_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 3,
    "min_p": 0.25,
    "seed": 5,
    "stop": ["x"],
    "stop_token_ids": [3],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "logprobs": 2,
    "prompt_logprobs": 2,
    "logprob_token_ids": [1],
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.5,
    "min_tokens": 2,
    "logit_bias": {"1": 1.0},
    "allowed_token_ids": [1],
    "bad_words": ["x"],
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a"],
    "guided_grammar": 'root ::= "a"',
    "embed": True,
    "lora": "adapter",
}

USER = {"role": "user", "content": "a"}

#: Each body with the least it needs to be valid.
BODIES: dict[type[BaseModel], dict[str, Any]] = {
    GenerateBody: {"prompt": "a"},
    CompletionBody: {"prompt": "a"},
    ChatBody: {"messages": [USER]},
    BatchChatBody: {"messages": [[USER]]},
    ResponsesBody: {"input": "a"},
}

#: What else a field needs to take effect (chat's `top_logprobs` counts with `logprobs`).
WITH: dict[str, dict[str, Any]] = {
    "ChatBody.top_logprobs": {"logprobs": True},
    "BatchChatBody.top_logprobs": {"logprobs": True},
    "ResponsesBody.top_logprobs": {"include": ["message.output_text.logprobs"]},
}


def _kwargs(body: BaseModel) -> dict[str, Any]:
    """The kwargs the body's route sends the engine (the length it settles included)."""
    if isinstance(body, GenerateBody):
        return body.to_sampling_params()
    if isinstance(body, OpenAISampling):
        return body.to_sampling_params(body.limit[0])
    assert isinstance(body, ResponsesBody)
    return body.to_sampling_params(body.max_output_tokens or 2**31 - 1)


def _declared(cls: type[BaseModel]) -> list[tuple[str, str]]:
    """(engine name, body name) of each `SamplingParams` field `cls` declares."""
    names: dict[str, str] = getattr(cls, "ENGINE_NAMES", {})
    pairs = [(name, names.get(name, name)) for name in sorted(SamplingParams.fields())]
    return [(name, field) for name, field in pairs if field in cls.model_fields]


def test_every_sampling_params_field_has_a_sample() -> None:
    assert set(SAMPLES) == SamplingParams.fields()


@pytest.mark.parametrize(
    ("cls", "name", "field"),
    [(cls, name, field) for cls in BODIES for name, field in _declared(cls)],
    ids=lambda value: value.__name__ if isinstance(value, type) else str(value),
)
def test_a_declared_sampling_field_reaches_the_engine(
    cls: type[BaseModel], name: str, field: str
) -> None:
    """A field set by the client goes to the engine under its `SamplingParams` name, so
    one declared on a body and not passed on fails here."""
    given = {**BODIES[cls], **WITH.get(f"{cls.__name__}.{field}", {}), field: SAMPLES[name]}
    kwargs = _kwargs(cls.model_validate(given))
    assert kwargs.get(name) == SAMPLES[name], (field, kwargs)
    assert set(kwargs) <= SamplingParams.fields()


@pytest.mark.parametrize("cls", list(BODIES), ids=lambda cls: cls.__name__)
def test_the_bodies_declare_the_fields_they_are_known_by(cls: type[BaseModel]) -> None:
    """Every body takes the common sampling fields (so the test above checks them)."""
    declared = {name for name, _ in _declared(cls)}
    assert {"max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs"} <= declared
