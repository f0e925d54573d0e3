"""One source for each rule (issue 11): every numeric range a request body may give is
the `Bound` of `kvscope.params`, and the HTTP schemas agree with it on every route.

The first test reads the schemas as `/openapi.json` documents them (what pydantic
validates); the second sends, to the native and both OpenAI routes, the value at each
bound (accepted) and the value just outside it (a 400 naming the field). A schema that
restates a range and drifts from `SamplingParams` fails one of them; a new bounded
field of `SamplingParams` is covered without editing this file.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from kvscope.params import PRIORITY, TIMEOUT, Bound, SamplingParams
from kvscope.web.native.schemas import SAMPLING_FIELDS, GenerateBody
from kvscope.web.openai.chat_schemas import ChatBody
from kvscope.web.openai.schemas import MAX_TEMPERATURE, CompletionBody

from .conftest import Live, wait_clean

BOUNDS = SamplingParams.bounds()
#: The OpenAI routes' names of `SamplingParams` fields where they differ.
CHAT_NAMES = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
#: OpenAI's own, narrower limits (a schema may narrow a range, never widen it).
NARROWED = {"temperature": MAX_TEMPERATURE}
#: The native route's fields whose range is not sampling's.
REQUEST_BOUNDS = {"priority": PRIORITY, "timeout": TIMEOUT}


def _range(schema: dict[str, Any]) -> dict[str, Any]:
    """A property's JSON-schema range (the non-null branch of an optional)."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") != "null":
            return {k: branch.get(k) for k in ("minimum", "exclusiveMinimum", "maximum")}
    raise AssertionError(schema)


def _expected(bound: Bound, hi: float | None = None) -> dict[str, Any]:
    return {
        "minimum": None if bound.lo_open else bound.lo,
        "exclusiveMinimum": bound.lo if bound.lo_open else None,
        "maximum": bound.hi if hi is None else hi,
    }


def test_every_schema_states_the_ranges_of_sampling_params() -> None:
    assert set(BOUNDS) >= {"temperature", "top_p", "top_k", "max_tokens", "seed", "logprobs"}
    native = GenerateBody.model_json_schema()["properties"]
    completion = CompletionBody.model_json_schema()["properties"]
    chat = ChatBody.model_json_schema()["properties"]
    for name, bound in BOUNDS.items():
        assert _range(native[name]) == _expected(bound), name
        hi = NARROWED.get(name)
        if hi is not None:
            assert hi <= bound.hi, name
        assert _range(completion[name]) == _expected(bound, hi), name
        assert _range(chat[CHAT_NAMES.get(name, name)]) == _expected(bound, hi), name
    for name, bound in REQUEST_BOUNDS.items():
        assert _range(native[name]) == _expected(bound), name
    assert _range(completion["priority"]) == _expected(PRIORITY)


def _up(value: float) -> float:
    return math.nextafter(value, math.inf)


def _down(value: float) -> float:
    return math.nextafter(value, -math.inf)


def _edges(bound: Bound, hi: float | None = None) -> tuple[list[Any], list[Any]]:
    """(values at the bounds, values just outside them)."""
    top = bound.hi if hi is None else hi
    if bound.integer:
        inside = [int(bound.lo), int(top)]
        return inside, [int(bound.lo) - 1, int(top) + 1]
    low = _up(bound.lo) if bound.lo_open else bound.lo
    below = bound.lo if bound.lo_open else _down(bound.lo)
    return [low, top], [below, _up(top)]


#: Every request takes one greedy token; `min_tokens` needs `max_tokens` above it.
BASE = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}


def _bodies(route: str, name: str, value: Any) -> tuple[dict[str, Any], str]:
    """The body setting `name` to `value` on `route`, and the name it is given there."""
    body: dict[str, Any] = dict(BASE)
    field = CHAT_NAMES.get(name, name) if route == "chat" else name
    if name == "min_tokens" and isinstance(value, int) and value > 0:
        body["max_tokens"] = min(value, int(BOUNDS["max_tokens"].hi))
    if route == "chat" and name == "max_tokens":
        del body["max_tokens"]
    if route == "chat" and name == "logprobs":
        body["logprobs"] = True
    body[field] = value
    if route == "native":
        body["prompt"] = "a"
    elif route == "completion":
        body["prompt"] = "a"
    else:
        body["messages"] = [{"role": "user", "content": "a"}]
    return body, field


PATHS = {"native": "/generate", "completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _accepted(response: httpx.Response, field: str) -> bool:
    if response.status_code in (200, 202):
        return True
    # A count of tokens at its bound is more than the context holds, or (log-probabilities,
    # -1 the vocabulary) more than the server's --max-logprobs: those 400s are the
    # server's own limits, not the field's range.
    message = response.json()["error"]["message"]
    limits = ("context length", "context is", "greater than max allowed")
    return response.status_code == 400 and any(limit in message for limit in limits)


def test_values_at_a_bound_are_taken_and_just_outside_are_a_400(live: Live) -> None:
    started = []
    with live.client() as client:
        for route, path in PATHS.items():
            for name, bound in BOUNDS.items():
                hi = NARROWED.get(name) if route != "native" else None
                inside, outside = _edges(bound, hi)
                for value in inside:
                    if (route, name, value) == ("native", "min_tokens", bound.hi):
                        continue  # test_min_tokens_beyond_the_context_is_a_400
                    body, field = _bodies(route, name, value)
                    response = client.post(path, json=body)
                    assert _accepted(response, field), (route, field, value, response.text)
                    if response.status_code == 202:
                        started.append(response.json()["id"])
                for value in outside:
                    body, field = _bodies(route, name, value)
                    response = client.post(path, json=body)
                    assert response.status_code == 400, (route, field, value, response.text)
                    error = response.json()["error"]
                    if route == "native":
                        assert error["message"].startswith(field), error
                    else:
                        assert (error["param"] or "").split(".")[0] == field, error
        for request_id in started:  # max_tokens at its bound runs to the context's end
            client.delete(f"/requests/{request_id}")
        for name, bound in REQUEST_BOUNDS.items():
            for value in _edges(bound)[1]:
                response = client.post(PATHS["native"], json={"prompt": "a", **BASE, name: value})
                assert response.status_code == 400, (name, value, response.text)
                assert response.json()["error"]["message"].startswith(name)
    wait_clean(live)


def test_min_tokens_beyond_the_context_is_a_400(live: Live) -> None:
    with live.client() as client:
        body = {"prompt": "a", "max_tokens": 10**6, "min_tokens": 10**6}
        response = client.post(PATHS["native"], json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith("min_tokens"), response.text


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_sampling_params_refuses_just_outside_its_own_bounds(name: str) -> None:
    inside, outside = _edges(BOUNDS[name])
    extra = {"max_tokens": 2**31 - 1} if name == "min_tokens" else {}
    for value in inside:
        SamplingParams(**{**extra, name: value})
    for value in outside:
        with pytest.raises(ValueError, match=f"^{name} "):
            SamplingParams(**{**extra, name: value})


def test_the_native_api_takes_every_sampling_params_field() -> None:
    assert set(SAMPLING_FIELDS) == SamplingParams.fields()


def test_the_engines_refusal_names_its_field_as_the_body_does(live: Live) -> None:
    """What only the engine can check (the vocabulary, a field against another) is
    refused by it, with the field its `InvalidRequest` carries: the 400's `param`, under
    the body's name for it."""
    chat = {"messages": [{"role": "user", "content": "a"}]}
    asks: list[tuple[str, dict[str, Any], str]] = [
        ("completion", {"prompt": [10**9]}, "prompt"),
        ("completion", {"prompt": "a", "logit_bias": {"1000000": 1}}, "logit_bias"),
        ("completion", {"prompt": "a", "min_tokens": 2}, "min_tokens"),
        ("chat", {**chat, "max_completion_tokens": 1, "min_tokens": 2}, "min_tokens"),
    ]
    with live.client() as client:
        for route, body, param in asks:
            response = client.post(PATHS[route], json={**BASE, **body})
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["param"] == param, (body, response.text)
    wait_clean(live)
