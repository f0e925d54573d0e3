"""The OpenAI-compatible routes, through the `openai` package pointed at the server."""

from __future__ import annotations

import openai
import pytest

from .conftest import LONG, Live, wait_clean, wait_status


def test_models_and_completions(live: Live, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-random"]
    out = client.completions.create(
        model="tiny-random",
        prompt="Hello",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    assert (
        out.usage.prompt_tokens == 6
        and out.usage.completion_tokens == 7
        and out.usage.total_tokens == 13
    )
    with live.client() as http:
        info = http.get(f"/requests/{out.id}").json()
        assert info["status"] == "finished" and info["text"] == out.choices[0].text


def test_chat_completion_and_seeded_n(live: Live, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny-random",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    first = client.completions.create(
        model="tiny-random",
        prompt="same prompt here",
        n=3,
        max_tokens=6,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    again = client.completions.create(
        model="tiny-random",
        prompt="same prompt here",
        n=3,
        max_tokens=6,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 18
    with live.client() as http:
        parent = http.get(f"/requests/{first.id}").json()
        assert len(parent["children"]) == 2
        for child in parent["children"]:
            assert http.get(f"/requests/{child}").json()["parent"] == first.id
    wait_clean(live)


def test_streaming_completion_and_chat(live: Live, client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="tiny-random",
            prompt="Hi",
            max_tokens=5,
            temperature=0,
            stream=True,
            n=2,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert {c.id for c in chunks} == {chunks[0].id}
    finals = [ch for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(ch.index for ch in finals) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 10
    # The two samples decode side by side, so their chunks interleave: sample 1's
    # first text arrives before sample 0 has finished.
    indices = [ch.index for c in chunks for ch in c.choices]
    assert indices.index(1) < max(i for i, index in enumerate(indices) if index == 0)
    stream = client.chat.completions.create(
        model="tiny-random",
        messages=[{"role": "user", "content": "yo"}],
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = list(stream)
    assert pieces[0].choices[0].delta.role == "assistant"
    assert pieces[-1].choices[0].finish_reason == "length"


def test_closing_a_stream_cancels_every_sample(live: Live, client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="tiny-random",
        prompt="long",
        n=2,
        stream=True,
        max_tokens=LONG["max_tokens"],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    stream.close()
    with live.client() as http:
        parent = wait_status(http, first.id)
        assert parent["status"] == "cancelled" and parent["cancel_reason"] == "disconnect"
        for child in parent["children"]:
            info = wait_status(http, child)
            assert info["status"] == "cancelled" and info["cancel_reason"] == "disconnect"
    assert live.audit_record(first.id)["cancel_reason"] == "disconnect"
    wait_clean(live)


def test_errors_in_openai_shape(live: Live, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-random", prompt="x", max_tokens=0)
    assert (
        caught.value.body["type"] == "invalid_request_error"
        and "max_tokens" in caught.value.body["message"]
    )
    assert "param" in caught.value.body and "code" in caught.value.body
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-random", prompt="x" * 10_000, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-random", messages=[], max_tokens=1)
