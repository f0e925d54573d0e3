"""The OpenAI contract through the real `openai` client: every field is honoured or
refused with a 400 naming it (`param`), never ignored; models by id, unknown models,
the context limit, seeds, `echo`, batched prompts (the same contract vLLM's
OpenAI-entrypoint tests check for completion, chat, echo, logit-bias validation,
basic and models)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .conftest import Live, running_server, sse_events, wait_clean, wait_status

MODEL = "tiny-random"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def refused(
    call: Any, param: str, status: type[openai.APIStatusError] = openai.BadRequestError
) -> dict:
    with pytest.raises(status) as caught:
        call()
    body = caught.value.body
    assert body["type"] and body["message"], body
    assert (body["param"] or "").split(".")[0] == param, body
    return body


def test_models_by_id_and_unknown_models(live: Live, client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    body = refused(lambda: client.models.retrieve("gpt-4o"), "model", openai.NotFoundError)
    assert body["code"] == "model_not_found"
    refused(
        lambda: client.completions.create(model="gpt-4o", prompt="x", max_tokens=1),
        "model",
        openai.NotFoundError,
    )
    refused(
        lambda: client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=1
        ),
        "model",
        openai.NotFoundError,
    )


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(
    backend: str, tmp_path: Path
) -> None:
    with (
        running_server(backend, tmp_path, max_model_len=64) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0) as client,
    ):
        assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 64
        body = refused(
            lambda: client.completions.create(model=MODEL, prompt="hello", max_tokens=64),
            "max_tokens",
        )
        # "hello" is 6 tokens (BOS and 5 bytes): 70 asked for a context of 64.
        assert "64" in body["message"] and "70" in body["message"]
        refused(
            lambda: client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=64,
            ),
            "max_completion_tokens",
        )
        refused(lambda: client.completions.create(model=MODEL, prompt="x" * 64), "prompt")
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=62, **GREEDY)
        assert out.usage.completion_tokens == 62
        # Unset, chat's max_tokens is what fits.
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], **GREEDY
        )
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 64


def test_the_engine_owns_the_context_rule_on_every_openai_route(
    backend: str, tmp_path: Path
) -> None:
    """Admission alone says whether a prompt and `max_tokens` fit (the OpenAI routes
    ask it to refuse a client's `max_tokens`, to cap their default): each route's 400
    names the field as its body does, the defaults run to what fits (16 at most for
    completions), streamed or searched as well."""
    user = [{"role": "user", "content": "hi"}]
    with (
        running_server(backend, tmp_path, max_model_len=64) as live,
        live.client() as http,
    ):
        asks: list[tuple[str, dict[str, Any], str]] = [
            ("/v1/chat/completions", {"messages": user, "max_tokens": 64}, "max_tokens"),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x" * 64}]},
                "messages",
            ),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 64}, "max_output_tokens"),
            ("/v1/responses", {"input": "x" * 64}, "input"),
            ("/v1/completions", {"prompt": "hello", "max_tokens": 64, **SEARCH}, "max_tokens"),
        ]
        for path, body, param in asks:
            answer = http.post(path, json={"model": MODEL, **body})
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["param"] == param, (body, answer.text)
            assert "maximum context length is 64" in answer.json()["error"]["message"]
        # A batch whose last prompt does not fit starts none of them.
        batch = {"model": MODEL, "prompt": ["hi", "x" * 59], "max_tokens": 10}
        answer = http.post("/v1/completions", json=batch)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
        assert live.stats()["cancelled"] == 0 and live.stats()["finished"] == 0
        # "x" * 59 is 60 tokens with the BOS: the default 16 is capped to the 4 that fit.
        body = {"model": MODEL, "prompt": "x" * 59, "temperature": 0, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 4
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/completions", json=stream) as response:
            events = [e for e in sse_events(response.iter_lines()) if e != "[DONE]"]
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 4
        searched = http.post("/v1/completions", json={**body, "n": 2, **SEARCH}).json()
        assert searched["usage"]["completion_tokens"] == 2 * 4, searched
        wait_clean(live)


#: A beam search's fields (vLLM's).
SEARCH = {"use_beam_search": True, "temperature": 0.0}


def test_any_64_bit_seed(client: openai.OpenAI) -> None:
    texts = [
        client.completions.create(model=MODEL, prompt="seed", max_tokens=6, seed=seed)
        .choices[0]
        .text
        for seed in (-(2**63), -(2**63), 2**63 - 1)
    ]
    assert texts[0] == texts[1]
    refused(lambda: client.completions.create(model=MODEL, prompt="x", seed=2**63), "seed")


def test_bodies_that_are_not_json_or_ask_for_a_stream_option_without_a_stream(
    live: Live, client: openai.OpenAI
) -> None:
    with live.client() as http:
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            response = http.post(
                "/v1/completions",
                content=b'{"model": "tiny-random", "prompt": "x"}',
                headers={"Content-Type": content_type},
            )
            assert response.status_code == 400, response.text
            assert "Content-Type" in response.json()["error"]["message"]
    refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, stream_options={"include_usage": True}
        ),
        "stream_options",
    )


def test_logprobs_and_logit_bias_out_of_range(client: openai.OpenAI) -> None:
    def completion(**fields: Any) -> Any:
        return lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, **fields)

    def chat(**fields: Any) -> Any:
        return lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, **fields
        )

    refused(completion(logprobs=21), "logprobs")
    refused(completion(logprobs=-1), "logprobs")
    refused(chat(logprobs=True, top_logprobs=21), "top_logprobs")
    refused(chat(top_logprobs=2), "top_logprobs")
    refused(completion(logit_bias={"not-a-token": 1}), "logit_bias")
    refused(completion(logit_bias={"1": "a lot"}), "logit_bias")
    refused(completion(logit_bias={"1": 101}), "logit_bias")
    refused(completion(logit_bias={"100000": 1}), "logit_bias")
    refused(completion(presence_penalty=2.5), "presence_penalty")
    refused(completion(extra_body={"repetition_penalty": 0}), "repetition_penalty")
    refused(completion(extra_body={"min_tokens": 5}), "min_tokens")  # above max_tokens


def test_fields_that_would_change_the_output_are_refused(client: openai.OpenAI) -> None:
    def completion(**fields: Any) -> Any:
        return lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1, **fields)

    def chat(**fields: Any) -> Any:
        return lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, **fields
        )

    refused(completion(suffix="tail"), "suffix")
    refused(completion(best_of=2, n=1), "best_of")
    searched = {"use_beam_search": True, "n": 2}
    refused(completion(top_p=0.5, extra_body=searched), "top_p")  # beam search drops it
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused(chat(tool_choice="auto"), "tool_choice")  # no tools to choose from
    refused(chat(extra_body={"functions": [tool["function"]]}), "functions")
    refused(chat(modalities=["audio"]), "modalities")
    # No effect on the output: accepted.
    out = chat(user="u-1", metadata={"k": "v"}, store=False, tool_choice="none")()
    assert out.choices[0].message.role == "assistant"


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=4, **GREEDY)
    echoed = client.completions.create(
        model=MODEL, prompt="Echo me", max_tokens=4, echo=True, **GREEDY
    )
    assert echoed.choices[0].text == "Echo me" + plain.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt="Echo me", max_tokens=4, echo=True, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_a_batch_of_prompts_is_one_family_per_prompt(live: Live, client: openai.OpenAI) -> None:
    prompts = ["first prompt", "second"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, **GREEDY).choices[0].text
        for p in prompts
    ]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert out.usage.prompt_tokens == 13 + 7 and out.usage.completion_tokens == 20
    ids = client.completions.create(model=MODEL, prompt=[[256, 104, 105], [256, 104]], max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    wait_clean(live)


def test_closing_a_batched_stream_cancels_every_prompt(live: Live) -> None:
    body = {
        "model": MODEL,
        "prompt": ["one long", "two long", "three"],
        "n": 2,
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with live.client() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            first = next(sse_events(response.iter_lines()))
        parent = wait_status(http, first["id"])
        assert parent["status"] == "cancelled" and parent["cancel_reason"] == "disconnect"
        # Every request of the call ends cancelled: nothing is left running.
        wait_clean(live)
    cancelled = [r for r in live.audit().values() if r["cancel_reason"] == "disconnect"]
    assert len(cancelled) == 6


def test_vllms_text_options_are_honoured(client: openai.OpenAI) -> None:
    """`add_special_tokens`, `include_stop_str_in_output` and `skip_special_tokens`
    reach the engine (their effects are tested there; here, that the routes pass them)."""
    with_bos = client.completions.create(model=MODEL, prompt="Count me", max_tokens=1)
    without = client.completions.create(
        model=MODEL, prompt="Count me", max_tokens=1, extra_body={"add_special_tokens": False}
    )
    assert without.usage.prompt_tokens == with_bos.usage.prompt_tokens - 1
    free = client.completions.create(model=MODEL, prompt="Stop me", max_tokens=30, **GREEDY)
    stop = next(
        (free.choices[0].text[i] for i in range(3, 30) if free.choices[0].text[i].isalnum()), None
    )
    if stop is None:
        pytest.skip("the random model produced no letter to stop on")
    kept = client.completions.create(
        model=MODEL,
        prompt="Stop me",
        max_tokens=30,
        stop=[stop],
        temperature=0,
        extra_body={"include_stop_str_in_output": True, "ignore_eos": True},
    )
    cut = free.choices[0].text
    assert kept.choices[0].text == cut[: cut.index(stop) + 1]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        extra_body={"skip_special_tokens": False},
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_continuous_usage_comes_with_every_chunk(client: openai.OpenAI) -> None:
    """vLLM's `stream_options.continuous_usage_stats`: each chunk carries its choice's
    usage so far, which only grows and ends at what the final usage chunk counts."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Count as you go",
            max_tokens=6,
            n=2,
            stream=True,
            stream_options=options,
            **GREEDY,
        )
    )
    total = chunks[-1].usage
    assert not chunks[-1].choices and total.completion_tokens == 12
    last = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        index = chunk.choices[0].index
        assert chunk.usage.prompt_tokens == total.prompt_tokens  # one prompt, n = 2
        assert chunk.usage.completion_tokens >= last[index]
        last[index] = chunk.usage.completion_tokens
    assert last == {0: 6, 1: 6}
    plain = client.completions.create(
        model=MODEL, prompt="Count as you go", max_tokens=3, stream=True, **GREEDY
    )
    assert all(chunk.usage is None for chunk in plain)


def test_a_prompt_truncated_to_its_last_tokens(client: openai.OpenAI) -> None:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens, as if sent alone."""
    ids = [256, *b"a long prompt that gets cut"]
    cut = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=4,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True},
    )
    tail = client.completions.create(model=MODEL, prompt=ids[-5:], max_tokens=4, **GREEDY)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a chat cut short"}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert chat.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"truncate_prompt_tokens": 0}
        )
    assert caught.value.body["param"] == "truncate_prompt_tokens"


def test_allowed_token_ids_bound_the_output(live: Live, client: openai.OpenAI) -> None:
    allowed = [ord(c) for c in "ab"]
    out = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=8,
        temperature=1.0,
        seed=4,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    assert len(out.choices[0].text) == 8 and set(out.choices[0].text) <= {"a", "b"}
    body = refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"allowed_token_ids": [10**6]}
        ),
        "allowed_token_ids",
    )
    assert "vocabulary" in body["message"]
    wait_clean(live)


def test_bad_words_stay_out_of_the_output(live: Live, client: openai.OpenAI) -> None:
    """Of two letters the only ones allowed, `bad_words` bans one (the tiny model's
    tokens are bytes, so each letter is a one-token word); the route names the field
    of a bad list."""
    allowed = {"allowed_token_ids": [ord(c) for c in "ab"], "ignore_eos": True}
    for create in (
        lambda **kw: client.completions.create(model=MODEL, prompt="x", **kw).choices[0].text,
        lambda **kw: (
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], **kw
            )
            .choices[0]
            .message.content
        ),
    ):
        text = create(max_tokens=8, temperature=1.0, extra_body={**allowed, "bad_words": ["a"]})
        assert text == "b" * 8
    refused(
        lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"bad_words": [""]}
        ),
        "bad_words",
    )
    wait_clean(live)


@pytest.fixture
def detailed(backend: str, tmp_path: Path) -> Iterator[tuple[Live, openai.OpenAI]]:
    """A server run with vLLM's `--enable-prompt-tokens-details`, and its client."""
    with (
        running_server(backend, tmp_path, prompt_tokens_details=True) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0) as client,
    ):
        yield live, client


def test_usage_says_how_much_of_the_prompt_was_cached(
    detailed: tuple[Live, openai.OpenAI],
) -> None:
    """With `--enable-prompt-tokens-details`, `prompt_tokens_details.cached_tokens`:
    none the first time, the full blocks the prefix cache holds the second (whole and
    in a stream's usage chunk); a batch counts each prompt once."""
    live, client = detailed
    prompt = "A prompt long enough to fill a few KV blocks of sixteen tokens each."
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens and cached % 16 == 0
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat,  # type: ignore[arg-type]
        max_tokens=2,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert 16 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    batch = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=1)
    assert batch.usage.prompt_tokens_details.cached_tokens == 2 * cached
    wait_clean(live)
