"""Log-probabilities by token id: vLLM's `return_tokens_as_token_ids` (the request
field, and the server's `--return-tokens-as-token-ids`). Each test makes the asserts of
the vLLM test it names (tests/entrypoints/openai/) on the real server through the
`openai` client, the tiny model's byte tokenizer in the place of Qwen's."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvscope import serve
from kvscope.models.tokenizer import ByteTokenizer
from kvscope.web.serve import settings_from

from .conftest import running_server

MODEL = "tiny-random"
#: Lower-case letters only: every token shows text.
LETTERS = {"allowed_token_ids": list(range(ord("a"), ord("z") + 1))}
TOKENIZER = ByteTokenizer()  # the tiny model's


def _id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


@pytest.fixture(params=[True, False], ids=["server-flag", "request-field"])
def as_ids(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Iterator[Any]:
    """The client and the body fields that ask for tokens by id: the server's flag, or
    the request's field."""
    flag = request.param
    with (
        running_server(backend, tmp_path, return_tokens_as_token_ids=flag) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0) as client,
    ):
        yield client, ({} if flag else {"return_tokens_as_token_ids": True})


def test_completion_tokens_as_token_ids(as_ids: Any) -> None:
    """test_return_tokens_as_ids.py::test_completion_return_tokens_as_token_ids_completion:
    each token and its top_logprobs' first key are the same `token_id:N`, and the ids
    decode to the text (the echoed prompt's too)."""
    client, extra = as_ids
    completion = client.completions.create(
        model=MODEL,
        prompt="Say 'Hello, world! 🎉'",
        echo=True,
        temperature=0,
        max_tokens=10,
        logprobs=1,
        extra_body={**extra, **LETTERS},
    )
    text = completion.choices[0].text
    token_strs = completion.choices[0].logprobs.tokens
    top_logprobs = completion.choices[0].logprobs.top_logprobs[1:]
    assert token_strs[1:] == [next(iter(by_token)) for by_token in top_logprobs]
    assert text == TOKENIZER.decode([_id(token) for token in token_strs])
    offsets = completion.choices[0].logprobs.text_offset
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], token_strs, strict=False))


def test_chat_tokens_as_token_ids(as_ids: Any) -> None:
    """test_return_tokens_as_ids.py::test_chat_return_tokens_as_token_ids_completion:
    the ids of the content's log-probabilities decode to it, the bytes stay the text's."""
    client, extra = as_ids
    messages: Any = [
        {"role": "system", "content": "You like to respond in only emojis, like 🎉"},
        {"role": "user", "content": "Please write some emojis: 🐱🐶🎉"},
    ]
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        extra_body={**extra, **LETTERS},
    )
    content = response.choices[0].logprobs.content
    token_ids = [_id(entry.token) for entry in content]
    assert TOKENIZER.decode(token_ids) == response.choices[0].message.content
    assert all(
        entry.bytes == list(TOKENIZER.decode([_id(entry.token)]).encode()) for entry in content
    )
    assert all(_id(top.token) >= 0 for entry in content for top in entry.top_logprobs)


def test_stream_tokens_as_token_ids(as_ids: Any) -> None:
    """A stream shows its tokens as the whole answer does, and a request's `false`
    overrides the server's flag."""
    client, extra = as_ids
    call: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "max_tokens": 6, "temperature": 0}
    call |= {"logprobs": 1, "extra_body": {**extra, **LETTERS}}
    whole = client.completions.create(**call).choices[0].logprobs
    streamed: list[str] = []
    offsets: list[int] = []
    for chunk in client.completions.create(stream=True, **call):
        streamed += chunk.choices[0].logprobs.tokens
        offsets += chunk.choices[0].logprobs.text_offset
    assert streamed == whole.tokens and offsets == whole.text_offset
    assert all(token.startswith("token_id:") for token in streamed)
    call["extra_body"] = {"return_tokens_as_token_ids": False, **LETTERS}
    plain = client.completions.create(**call).choices[0]
    assert plain.logprobs.tokens == list(plain.text)


def test_the_flag_is_vllms() -> None:
    """`kvscope serve --return-tokens-as-token-ids`, as `vllm serve` takes it."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert settings_from(
        parser.parse_args(["--return-tokens-as-token-ids"])
    ).return_tokens_as_token_ids
    assert not settings_from(parser.parse_args([])).return_tokens_as_token_ids


def _one_token(**extra: Any) -> dict[str, Any]:
    """A chat call for one greedy token's log-probabilities, with `extra` in its body."""
    messages = [{"role": "user", "content": "Hello"}]
    call = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
    return {**call, "logprobs": True, "extra_body": extra}


@pytest.mark.parametrize(
    ("requested_ids", "top_logprobs", "sampled_id"),
    [([200], 5, 42), ([100, 150, 200], 3, 42), ([100, 150, 200], 3, 200)],
)
def test_chat_logprob_token_ids(
    client: openai.OpenAI, requested_ids: list[int], top_logprobs: int, sampled_id: int
) -> None:
    """chat_completion/test_logprob_token_ids.py::test_logprob_token_ids_returns_requested_ids:
    a token's alternatives are the sampled token and the ones named, once each."""
    pinned = {"logprob_token_ids": requested_ids, "allowed_token_ids": [sampled_id]}
    resp = client.chat.completions.create(
        top_logprobs=top_logprobs, **_one_token(**pinned, return_tokens_as_token_ids=True)
    )
    content: Any = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    returned = [_id(entry.token) for entry in content[0].top_logprobs]
    assert _id(content[0].token) == sampled_id
    assert set(returned) == {*requested_ids, sampled_id}
    assert len(returned) == len(set(returned))
    assert all(-math.inf < entry.logprob <= 0 for entry in content[0].top_logprobs)


def test_logprob_token_ids_streamed_and_on_completions(client: openai.OpenAI) -> None:
    """test_logprob_token_ids_stream_with_no_top_k (chat) and completion/test_completion.py's
    test_logprob_token_ids and test_logprob_token_ids_stream; `logprob_token_ids` with
    beam search, or without `logprobs`, is a 400 naming it."""
    extra = {
        "logprob_token_ids": [200],
        "allowed_token_ids": [42],
        "return_tokens_as_token_ids": True,
    }
    stream = client.chat.completions.create(stream=True, **_one_token(**extra))
    returned: list[int] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for content in chunk.choices[0].logprobs.content or ():
                returned += [_id(entry.token) for entry in content.top_logprobs]
    assert set(returned) == {42, 200}
    call: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    choice: Any = client.completions.create(logprobs=5, extra_body=extra, **call).choices[0]
    assert choice.logprobs.tokens == ["token_id:42"]
    assert set(choice.logprobs.top_logprobs[0]) == {"token_id:42", "token_id:200"}
    tops = [
        top
        for chunk in client.completions.create(logprobs=5, stream=True, extra_body=extra, **call)
        for top in chunk.choices[0].logprobs.top_logprobs or ()  # type: ignore[union-attr]
        if top is not None
    ]
    assert len(tops) == 1 and set(tops[0]) == {"token_id:42", "token_id:200"}
    for bad in (
        {"logprob_token_ids": [1]},
        {"logprob_token_ids": [1], "use_beam_search": True},
        {"logprob_token_ids": [258], "logprobs": 1},
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**call, extra_body=bad)
        assert refused.value.body["param"] == "logprob_token_ids", refused.value.body  # type: ignore[index]
