"""vLLM's decode-side token reuse on `/v1/chat/completions`: a disaggregated router
forwards the prefill stage's prompt ids in `kv_transfer_params`, and the decode stage
answers them verbatim instead of rendering its own messages. The asserts of vLLM's
chat_completion/test_chat_completion.py::test_kv_transfer_prompt_token_ids_*, on the
real server through the `openai` client, and the 400s of bad forwarded ids."""

from __future__ import annotations

from typing import Any

import openai
import pytest

MODEL = "tiny-random"
PREFILL_MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]
DECODE_MESSAGES = [{"role": "user", "content": "unrelated decode-side text"}]


def _prefill_ids(client: openai.OpenAI) -> list[int]:
    baseline = client.chat.completions.create(
        model=MODEL,
        messages=PREFILL_MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    ids = baseline.prompt_token_ids  # type: ignore[attr-defined]
    assert ids
    return list(ids)


def _decode(client: openai.OpenAI, ids: Any, **more: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=DECODE_MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=6,
        temperature=0,
        extra_body={"kv_transfer_params": {"prompt_token_ids": ids}, "return_token_ids": True},
        **more,
    )


def test_forwarded_prompt_ids_are_the_prompt(client: openai.OpenAI) -> None:
    reused = _prefill_ids(client)
    decode = _decode(client, reused)
    assert decode.prompt_token_ids == reused
    assert decode.usage.prompt_tokens == len(reused)
    own = client.chat.completions.create(
        model=MODEL,
        messages=DECODE_MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=1,
        extra_body={"return_token_ids": True},
    )
    assert own.prompt_token_ids != reused  # type: ignore[attr-defined]


def test_forwarded_prompt_ids_stream(client: openai.OpenAI) -> None:
    reused = _prefill_ids(client)
    chunks = list(_decode(client, reused, stream=True))
    assert chunks[0].prompt_token_ids == reused
    token_ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    assert len(token_ids) == 6


def test_echo_renders_the_messages_instead(client: openai.OpenAI) -> None:
    """vLLM's rule: `echo` needs the messages, so the forwarded ids are ignored."""
    reused = _prefill_ids(client)
    echoed = client.chat.completions.create(
        model=MODEL,
        messages=DECODE_MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=1,
        extra_body={
            "kv_transfer_params": {"prompt_token_ids": reused},
            "return_token_ids": True,
            "echo": True,
        },
    )
    assert echoed.prompt_token_ids != reused  # type: ignore[attr-defined]


@pytest.mark.parametrize("ids", [[], [1, "2"], [True], [-1], [10**9], "1 2"])
def test_bad_forwarded_ids_are_a_400_naming_them(client: openai.OpenAI, ids: Any) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _decode(client, ids)
    assert refused.value.body["param"] == "kv_transfer_params.prompt_token_ids"  # type: ignore[index]


def test_the_batch_route_refuses_forwarded_ids(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.post(
            "/chat/completions/batch",
            cast_to=object,
            body={
                "model": MODEL,
                "messages": [DECODE_MESSAGES, PREFILL_MESSAGES],
                "kv_transfer_params": {"prompt_token_ids": [1, 2]},
            },
        )
    assert refused.value.body["param"] == "kv_transfer_params"  # type: ignore[index]
