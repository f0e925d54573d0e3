"""Where vLLM and OpenAI allow several shapes, kvscope answers in vLLM's: each test
makes the asserts of the vLLM test it names (vLLM's `tests/entrypoints/openai/`), on
the real server through the `openai` client (README, "vLLM conformance")."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvscope.models.loader import BUNDLED_DIR
from kvscope.models.tokenizer import ByteTokenizer, HFTokenizer

from .conftest import Live, serve_cli

MODEL = "tiny-random"
#: Lower-case letters only: every token shows text, so the last one's chunk has some.
LETTERS = {"allowed_token_ids": list(range(ord("a"), ord("z") + 1)), "ignore_eos": True}


@pytest.fixture
def vllm_cli(backend: str) -> Iterator[tuple[openai.OpenAI, subprocess.Popen[str]]]:
    """`kvscope serve` on the bundled checkpoint's path as `vllm serve` is run in vLLM's
    tests: another served name, and `--enable-prompt-tokens-details`."""
    process, url = serve_cli(
        backend,
        "--served-model-name",
        "served-name",
        "--enable-prompt-tokens-details",
        "--worker",
        "thread",
        model=str(BUNDLED_DIR),
    )
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60) as cli:
            yield cli, process
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=60)
        assert process.returncode == 0, log[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_finish_reason_rides_on_the_last_tokens_chunk(client: openai.OpenAI) -> None:
    """1. Mirrors completion/test_completion.py::test_completion_streaming and
    chat_completion/test_chat.py::test_chat_streaming: one chunk carries the finish
    reason, the last, with the last token's text."""
    call = {"model": MODEL, "max_tokens": 5, "temperature": 0.0, "extra_body": LETTERS}
    single_output = client.completions.create(prompt="What is an LLM?", **call).choices[0].text
    stream = client.completions.create(prompt="What is an LLM?", stream=True, **call)
    chunks: list[str] = []
    finish_reason_count = 0
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    # finish reason should only return in last block
    assert finish_reason_count == 1
    assert chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].text
    assert "".join(chunks) == single_output

    messages: Any = [{"role": "user", "content": "what is 1+1?"}]
    output = client.chat.completions.create(messages=messages, **call).choices[0].message.content
    chat = client.chat.completions.create(messages=messages, stream=True, **call)
    pieces: list[str] = []
    finish_reason_count = 0
    for piece in chat:
        delta = piece.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            pieces.append(delta.content)
        if piece.choices[0].finish_reason is not None:
            finish_reason_count += 1
    assert finish_reason_count == 1
    assert piece.choices[0].finish_reason == "length"
    assert delta.content
    assert "".join(pieces) == output


def test_a_last_event_without_text_still_carries_the_finish_reason(
    client: openai.OpenAI,
) -> None:
    """1. vLLM's serving_completion.py sends the chunk of a request's last output even
    when it brings no text (a stop string cut away): text "" and the finish reason."""
    call = {"model": MODEL, "prompt": "Cut me", "temperature": 0.0}
    free = client.completions.create(max_tokens=12, extra_body=LETTERS, **call).choices[0].text
    cut = next((i for i in range(2, len(free)) if free[i] not in free[:i]), None)
    if cut is None:
        pytest.skip("the random model repeated every letter: no stop string to cut at")
    stream = client.completions.create(
        max_tokens=12, stop=[free[cut]], stream=True, extra_body=LETTERS, **call
    )
    chunks = list(stream)
    finished = [c for c in chunks if c.choices[0].finish_reason is not None]
    assert finished == [chunks[-1]]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].text == ""
    assert "".join(c.choices[0].text for c in chunks) == free[:cut]


def test_prompt_logprobs_is_null_unless_asked(live: Live, client: openai.OpenAI) -> None:
    """2. Mirrors completion/test_completion.py::test_single_completion (token ids) and
    test_prompt_logprobs_completion (None): the SDK reads `prompt_logprobs`, null."""
    completion = client.completions.create(
        model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0, extra_body=LETTERS
    )
    assert len(completion.choices[0].text) >= 1
    assert completion.choices[0].prompt_logprobs is None  # type: ignore[attr-defined]
    batch = client.completions.create(model=MODEL, prompt=["A robot may not", "My name is"])
    assert all(choice.prompt_logprobs is None for choice in batch.choices)  # type: ignore[attr-defined]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert chat.prompt_logprobs is None  # type: ignore[attr-defined]
    with live.client() as http:  # null, not absent
        raw = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()
        assert "prompt_logprobs" in raw["choices"][0]


def test_completion_logprobs_hold_the_sampled_token(client: openai.OpenAI) -> None:
    """3. Mirrors completion/test_completion.py::test_zero_logprobs, test_some_logprobs
    and test_echo_logprob_completion: the sampled token is always in `top_logprobs`."""
    call = {"model": MODEL, "prompt": [0, 0, 0, 0, 0], "max_tokens": 5, "temperature": 0.0}
    choice = client.completions.create(logprobs=0, **call).choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    assert len(choice.logprobs.top_logprobs[0]) == 1
    choice = client.completions.create(logprobs=5, **call).choices[0]
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    assert 5 <= len(choice.logprobs.top_logprobs[0]) <= 6
    for logprobs_arg in (1, 0):
        for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
            completion = client.completions.create(
                model=MODEL,
                prompt=prompt,  # type: ignore[arg-type]
                max_tokens=5,
                temperature=0.0,
                echo=True,
                logprobs=logprobs_arg,
            )
            tokenizer = ByteTokenizer()  # the tiny model's
            prompt_text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
            assert re.search(r"^" + prompt_text, completion.choices[0].text)
            logprobs = completion.choices[0].logprobs
            assert logprobs is not None
            assert len(logprobs.text_offset) > 5  # type: ignore[arg-type]
            assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None  # type: ignore[arg-type]
            assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None  # type: ignore[arg-type]
            for top_logprobs in logprobs.top_logprobs[1:]:  # type: ignore[index]
                assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
            assert len(logprobs.tokens) > 5  # type: ignore[arg-type]


def test_echo_of_token_ids_shows_their_special_tokens(
    vllm_cli: tuple[openai.OpenAI, subprocess.Popen[str]],
) -> None:
    """4. Mirrors completion/test_completion.py::test_echo_logprob_completion with
    token ids: the echo begins with `tokenizer.decode(prompt)`, special tokens kept
    (the bundled model's id 0 is `<s>`)."""
    cli, _process = vllm_cli
    tokenizer = HFTokenizer(BUNDLED_DIR)
    prompt = [0, 0, 0, 0, 0]
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert prompt_text == "<s>" * 5
    for logprobs_arg in (None, 0, 1):
        completion = cli.completions.create(
            model="served-name",
            prompt=prompt,
            max_tokens=5,
            temperature=0.0,
            echo=True,
            logprobs=logprobs_arg,
        )
        assert re.search(r"^" + prompt_text, completion.choices[0].text)
    streamed = cli.completions.create(
        model="served-name", prompt=prompt, max_tokens=3, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed).startswith(prompt_text)


def test_continuous_usage_needs_include_usage(client: openai.OpenAI) -> None:
    """5. Mirrors completion/test_completion.py::test_completion_stream_options."""
    prompt = "What is the capital of France?"
    call = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0.0}
    options: dict[str, Any] = {"include_usage": False, "continuous_usage_stats": True}
    for chunk in client.completions.create(stream=True, stream_options=options, **call):
        assert chunk.usage is None
    options = {"include_usage": True, "continuous_usage_stats": False}
    stream = client.completions.create(stream=True, stream_options=options, **call)
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            assert chunk.usage is None
        else:
            assert chunk.usage is None
            final_chunk = next(stream)
            assert final_chunk.usage is not None
            assert final_chunk.usage.prompt_tokens > 0
            assert final_chunk.usage.completion_tokens > 0
            assert final_chunk.usage.total_tokens == (
                final_chunk.usage.prompt_tokens + final_chunk.usage.completion_tokens
            )
            assert final_chunk.choices == []
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.completions.create(stream=True, stream_options=options, **call)
    for chunk in stream:
        assert chunk.usage is not None
        assert chunk.usage.prompt_tokens > 0
        assert chunk.usage.completion_tokens > 0
        assert chunk.usage.total_tokens == (
            chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        )
        if chunk.choices[0].finish_reason is not None:
            final_chunk = next(stream)
            assert final_chunk.usage is not None
            assert final_chunk.choices == []
    for chunk in client.completions.create(stream=True, stream_options={}, **call):
        assert chunk.usage is None


def test_prompt_tokens_details_only_under_the_flag(
    client: openai.OpenAI, vllm_cli: tuple[openai.OpenAI, subprocess.Popen[str]]
) -> None:
    """6. Mirrors completion/test_completion.py::test_single_completion, whose server
    runs with `--enable-prompt-tokens-details`; without it vLLM sends no details."""
    cli, _process = vllm_cli
    completion = cli.completions.create(
        model="served-name", prompt="Hello, my name is", max_tokens=5, temperature=0.0
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    plain = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5)
    assert plain.usage is not None and plain.usage.prompt_tokens_details is None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is None


def test_whole_answers_carry_service_tier_and_system_fingerprint(live: Live) -> None:
    """7. vLLM's protocol.py: `ChatCompletionResponse` and `CompletionResponse` have
    `service_tier` and `system_fingerprint`, null; its chunks are dumped with
    `exclude_unset`, so they carry neither."""
    with live.client() as http:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "x"})):
            whole = http.post(path, json=body).json()
            assert whole["service_tier"] is None and whole["system_fingerprint"] is None
            assert "service_tier" in whole and "system_fingerprint" in whole
            with http.stream("POST", path, json={**body, "stream": True}) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            assert lines and not any("service_tier" in line for line in lines)


def test_every_bad_logit_bias_key_is_named(client: openai.OpenAI) -> None:
    """8. Mirrors chat_completion/test_chat_logit_bias_validation.py:
    test_chat_logit_bias_multiple_non_integer_keys and test_chat_logit_bias_invalid."""
    messages: Any = [{"role": "user", "content": "Testing multiple bad keys"}]
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            logit_bias={"bad1": 50.0, "bad2": 20.0},
        )
    error_message = str(excinfo.value)
    assert excinfo.value.status_code == 400
    assert "bad1" in error_message
    assert "bad2" in error_message
    vocab_size = ByteTokenizer.vocab_size  # the tiny model's
    invalid_token_id = vocab_size + 1
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, logit_bias={str(invalid_token_id): 1.0}
        )
    assert excinfo.value.status_code == 400
    assert str(invalid_token_id) in str(excinfo.value)
    assert str(vocab_size) in str(excinfo.value)


def test_validation_errors_and_the_model_root_are_vllms(
    client: openai.OpenAI, vllm_cli: tuple[openai.OpenAI, subprocess.Popen[str]]
) -> None:
    """9. vLLM's api_server.py `validation_exception_handler`: the message carries
    pydantic's errors (their `type`, such as `greater_than_equal`); and mirrors
    models/test_models.py::test_check_models: `root` is the model's path."""
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=MODEL, prompt="x", n=0)
    message = excinfo.value.body["message"]  # type: ignore[index]
    assert "greater_than_equal" in message and "('body', 'n')" in message
    assert message.startswith("1 validation error:")
    assert excinfo.value.body["param"] == "n"  # type: ignore[index]
    cli, _process = vllm_cli
    served_model = cli.models.list().data[0]
    assert served_model.id == "served-name"
    assert served_model.root == str(BUNDLED_DIR)  # type: ignore[attr-defined]
    assert Path(served_model.root).is_dir()  # type: ignore[attr-defined]
