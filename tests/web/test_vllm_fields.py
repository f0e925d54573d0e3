"""vLLM's smaller rules on the OpenAI routes: each test makes the asserts of the vLLM
test it names (tests/entrypoints/openai/) on the real server through the `openai`
client, the tiny model in the place of the test's: seeds, custom roles, the prompt
checks' words, `--enable-force-include-usage`, and `-1` for every token's
log-probabilities under `--max-logprobs`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvscope import serve
from kvscope.web.serve import settings_from

from .conftest import Live, running_server

MODEL = "tiny-random"
VOCAB = 258  # the tiny model's
MESSAGES: Any = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Beijing is the capital of which country?"},
]


def _served(backend: str, tmp_path: Path, **options: Any) -> Iterator[openai.OpenAI]:
    with (
        running_server(backend, tmp_path, **options) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0) as client,
    ):
        yield client


def test_long_seed(client: openai.OpenAI) -> None:
    """chat_completion/test_chat.py::test_long_seed: a seed past a signed 64-bit
    integer is a 400 in pydantic's words; the ends of the range are taken."""
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(openai.BadRequestError) as exc_info:
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES[:1], temperature=0, seed=seed, max_tokens=1
            )
        message = exc_info.value.message
        assert "greater_than_equal" in message or "less_than_equal" in message
    for seed in (-(2**63), 2**63 - 1):
        client.chat.completions.create(model=MODEL, messages=MESSAGES[:1], seed=seed, max_tokens=2)


def test_custom_role(client: openai.OpenAI) -> None:
    """chat_completion/test_chat.py::test_custom_role: a role of the client's own goes
    to the template, its content as text or as parts alike."""
    contents: list[Any] = ["what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]]
    answers = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "my-custom-role", "content": content}],  # type: ignore[misc,list-item]
            temperature=0,
            seed=0,
            max_tokens=5,
        )
        .choices[0]
        .message.content
        for content in contents
    ]
    assert answers[0] == answers[1]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "", "content": "x"}],  # type: ignore[misc,list-item]
        )


def test_prompt_validation(client: openai.OpenAI) -> None:
    """completion/test_prompt_validation.py::test_empty_prompt and
    test_out_of_vocab_token_ids, in vLLM's words; prompt embeddings are refused."""
    with pytest.raises(
        openai.BadRequestError,
        match="Either prompt or prompt_embeds must be provided and non-empty.",
    ):
        client.completions.create(
            model=MODEL,
            prompt=None,  # type: ignore[arg-type]
            max_tokens=5,
            temperature=0.0,
            extra_body={"prompt_embeds": []},
        )
    with pytest.raises(openai.BadRequestError, match=".*out of vocabulary.*"):
        client.completions.create(model=MODEL, prompt=[999999], max_tokens=5, temperature=0.0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", extra_body={"prompt_embeds": "AAAA"})
    assert refused.value.body["param"] == "prompt_embeds"  # type: ignore[index]


@pytest.fixture
def forced(backend: str, tmp_path: Path) -> Iterator[openai.OpenAI]:
    yield from _served(backend, tmp_path, force_include_usage=True)


def test_chat_with_enable_force_include_usage(forced: openai.OpenAI) -> None:
    """chat_completion/test_enable_force_include_usage.py: with the flag, every chunk
    carries the usage so far, and a last chunk the whole usage, unasked."""
    stream = forced.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=10,
        extra_body={"min_tokens": 10},
        temperature=0.0,
        stream=True,
    )
    last_completion_tokens, chunks = 0, 0
    for chunk in stream:
        chunks += 1
        assert chunk.usage is not None and chunk.usage.prompt_tokens >= 0
        assert (
            last_completion_tokens == 0
            or chunk.usage.completion_tokens > last_completion_tokens
            or (not chunk.choices and chunk.usage.completion_tokens == last_completion_tokens)
        )
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        last_completion_tokens = chunk.usage.completion_tokens
    assert last_completion_tokens == 10 and not chunk.choices and chunks > 2
    whole = forced.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert whole.usage is not None and whole.usage.completion_tokens == 2


def test_the_flags_are_vllms() -> None:
    """`--enable-force-include-usage` and `--max-logprobs`, as `vllm serve` takes them."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--enable-force-include-usage", "--max-logprobs", "-1"])
    assert settings_from(args).force_include_usage and args.max_logprobs == -1
    assert not settings_from(parser.parse_args([])).force_include_usage


@pytest.fixture
def every_token(backend: str, tmp_path: Path) -> Iterator[openai.OpenAI]:
    yield from _served(backend, tmp_path, max_logprobs=VOCAB)


def test_prompt_logprobs_and_top_logprobs_of_every_token(every_token: openai.OpenAI) -> None:
    """chat_completion/test_chat_echo.py::test_prompt_logprobs and test_top_logprobs
    (the server run with `--max-logprobs` the vocabulary): -1 is every token, and
    `logprobs` may come as the string "true", as vLLM reads it."""
    completion = every_token.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": -1}
    )
    prompt_logprobs: Any = completion.prompt_logprobs  # type: ignore[attr-defined]
    assert prompt_logprobs is not None and len(prompt_logprobs) > 0
    assert all(len(entry) == VOCAB for entry in prompt_logprobs[1:])
    completion = every_token.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"top_logprobs": -1, "logprobs": "true"},
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    assert len(logprobs.content[0].top_logprobs) == VOCAB
    choice = every_token.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=-1)
    top = choice.choices[0].logprobs.top_logprobs  # type: ignore[union-attr]
    assert top is not None and len(top[0]) == VOCAB


def test_more_than_max_logprobs_is_a_400(live: Live, client: openai.OpenAI) -> None:
    """completion/test_completion.py::test_too_many_completion_logprobs: past
    `--max-logprobs` (20 unless told; -1 is the vocabulary) is a 400 naming the field,
    and the server serves on."""
    asks: list[tuple[str, dict[str, Any]]] = [
        ("logprobs", {"prompt": [0, 0, 0], "logprobs": 21}),
        ("logprobs", {"prompt": [0, 0, 0], "logprobs": -1}),
        ("prompt_logprobs", {"prompt": "x", "prompt_logprobs": -1}),
        ("top_logprobs", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}),
        ("logprobs", {"messages": MESSAGES, "logprobs": "yes please"}),
    ]
    with live.client() as http:
        for field, body in asks:
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            refused = http.post(route, json={"max_tokens": 2, **body})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"].split(".")[0] == field, refused.text
        include = ["message.output_text.logprobs"]
        body = {"input": "x", "include": include, "top_logprobs": 21, "max_output_tokens": 2}
        refused = http.post("/v1/responses", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0], logprobs=20)
    assert completion.choices[0].logprobs is not None
