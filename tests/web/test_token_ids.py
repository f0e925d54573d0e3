"""vLLM's `return_token_ids` (and `truncation_side`) on `/v1/completions` and
`/v1/chat/completions`, whole and streamed: each test makes the asserts of vLLM's
tests/entrypoints/openai/test_return_token_ids.py (or the test it names) on the real
server through the `openai` client, the tiny model's byte tokenizer in the place of
Qwen's."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kvscope.models.tokenizer import ByteTokenizer

from .conftest import Live

MODEL = "tiny-random"
#: Lower-case letters only: every token shows text.
LETTERS = {"allowed_token_ids": list(range(ord("a"), ord("z") + 1))}
TOKENIZER = ByteTokenizer()  # the tiny model's


@pytest.mark.parametrize("return_token_ids", [True, False, None])
def test_completion_token_ids(client: openai.OpenAI, return_token_ids: bool | None) -> None:
    """test_basic_completion_with_emoji: the prompt's ids hold the encoded prompt, the
    choice's decode to its text; null (the key still there) unless asked."""
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    extra = {} if return_token_ids is None else {"return_token_ids": return_token_ids}
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=1, extra_body=extra
    )
    choice = completion.model_dump()["choices"][0]
    assert "prompt_token_ids" in choice
    if not return_token_ids:
        assert choice.get("token_ids") is None and choice.get("prompt_token_ids") is None
        return
    assert choice["prompt_token_ids"] == TOKENIZER.encode(prompt)
    assert len(choice["token_ids"]) == 10
    assert TOKENIZER.decode(choice["token_ids"]).startswith(choice["text"])


def test_truncation_side_picks_the_end_kept(client: openai.OpenAI) -> None:
    """completion/test_completion.py::test_completion_truncation_side_controls_prompt_truncation."""
    prompt_token_ids = list(range(8))
    for side, kept in (("right", prompt_token_ids[:4]), ("left", prompt_token_ids[-4:])):
        completion = client.completions.create(
            model=MODEL,
            prompt=prompt_token_ids,
            max_tokens=1,
            temperature=0.0,
            extra_body={
                "return_token_ids": True,
                "truncate_prompt_tokens": 4,
                "truncation_side": side,
            },
        )
        assert completion.choices[0].prompt_token_ids == kept  # type: ignore[attr-defined]


def test_completion_stream_token_ids_match_the_whole_answer(client: openai.OpenAI) -> None:
    """test_comparison_with_prompt_logprobs_and_logprobs's stream: the prompt's ids on
    the first chunk, each chunk's tokens beside its log-probabilities, all of them the
    whole answer's."""
    call: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Tell me a short fact about Python:",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 1,
        "extra_body": {"return_token_ids": True},
    }
    whole = client.completions.create(**call).choices[0]
    chunks = list(client.completions.create(stream=True, **call))
    first = chunks[0].choices[0]
    assert first.prompt_token_ids == TOKENIZER.encode(call["prompt"])  # type: ignore[attr-defined]
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])  # type: ignore[attr-defined]
    streamed: list[int] = []
    for chunk in chunks:
        choice = chunk.choices[0]
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert len(choice.logprobs.tokens) == len(choice.token_ids)  # type: ignore[attr-defined]
        streamed += choice.token_ids  # type: ignore[attr-defined]
    assert streamed == whole.token_ids  # type: ignore[attr-defined]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_echo_with_token_ids_and_prompt_logprobs(client: openai.OpenAI) -> None:
    """test_comparison_with_prompt_logprobs_and_logprobs, whole: the echoed prompt's
    log-probabilities come before the tokens', whose ids end them."""
    completion = client.completions.create(
        model=MODEL,
        prompt="Hello, world! How are you today?",
        max_tokens=20,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"return_token_ids": True, "prompt_logprobs": 1, **LETTERS},
    )
    choice: Any = completion.choices[0]
    assert choice.token_ids is not None and choice.prompt_token_ids is not None
    assert choice.prompt_logprobs is not None and choice.logprobs is not None
    assert len(choice.token_ids) < len(choice.logprobs.tokens)
    assert "Hello, world" in TOKENIZER.decode(choice.prompt_token_ids)
    assert choice.text.endswith(TOKENIZER.decode(choice.token_ids))


def test_chat_token_ids(live: Live, client: openai.OpenAI) -> None:
    """test_chat_completion_with_emoji_and_token_ids: the rendered prompt's ids on the
    answer (and on the stream's first chunk only), the choice's ids decode to its
    content, the stream's to the same."""
    messages: Any = [
        {"role": "system", "content": "You like to use emojis in your responses."},
        {"role": "user", "content": "Repeat after me: I love cats 🐱"},
    ]
    call: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 20}
    call |= {"temperature": 0, "extra_body": {"return_token_ids": True, **LETTERS}}
    response = client.chat.completions.create(logprobs=True, **call)
    assert "prompt_token_ids" in response.model_dump()
    prompt = TOKENIZER.decode(response.prompt_token_ids)  # type: ignore[attr-defined]
    assert prompt.startswith("system: You like to use emojis in your responses.")
    assert prompt.endswith("I love cats 🐱\nassistant:")
    token_ids = response.choices[0].token_ids  # type: ignore[attr-defined]
    assert TOKENIZER.decode(token_ids) == response.choices[0].message.content
    content, streamed = "", list[int]()
    for number, chunk in enumerate(client.chat.completions.create(stream=True, **call)):
        if number == 0:
            assert chunk.prompt_token_ids == response.prompt_token_ids  # type: ignore[attr-defined]
        else:
            assert "prompt_token_ids" not in chunk.model_dump()
        content += chunk.choices[0].delta.content or ""
        streamed += chunk.choices[0].model_dump().get("token_ids") or []
    assert content == response.choices[0].message.content
    assert streamed == token_ids
    without = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"return_token_ids": False}
    )
    assert without.choices[0].token_ids is None  # type: ignore[attr-defined]
    assert without.prompt_token_ids is None  # type: ignore[attr-defined]


def test_each_sample_of_a_stream_gets_the_prompt_ids(client: openai.OpenAI) -> None:
    """With `n`, each choice's first chunk carries its prompt's ids, and its chunks
    carry its own tokens."""
    stream = client.completions.create(
        model=MODEL,
        prompt=["ab", "cd"],
        n=2,
        max_tokens=4,
        stream=True,
        extra_body={"return_token_ids": True, **LETTERS},
    )
    prompts: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {}
    for chunk in stream:
        choice: Any = chunk.choices[0]
        if choice.index not in prompts:
            prompts[choice.index] = choice.prompt_token_ids
        tokens.setdefault(choice.index, []).extend(choice.token_ids)
    assert prompts == {i: TOKENIZER.encode("ab" if i < 2 else "cd") for i in range(4)}
    assert all(len(ids) == 4 for ids in tokens.values())
