"""vLLM's `POST /v1/chat/completions/batch`: each test makes the asserts of vLLM's
chat_completion/test_batched_chat_completions.py test it names on the real server (the
tiny model in the place of Qwen's), and checks what vLLM's route refuses."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .conftest import Live

MODEL = "tiny-random"
#: Lower-case letters only: every answer shows text.
LETTERS = {"allowed_token_ids": list(range(ord("a"), ord("z") + 1)), "max_tokens": 4}
ALPHA = [{"role": "user", "content": "Reply with exactly the word: alpha"}]
BETA = [{"role": "user", "content": "Reply with exactly the word: beta"}]


def _batch(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions/batch", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_batched_chat_completions(live: Live) -> None:
    """test_batched_chat_completions: a choice per conversation, each as the chat of
    that conversation alone would answer it, usage summed."""
    with live.client() as http:
        data = _batch(http, messages=[ALPHA, BETA], temperature=0, **LETTERS)
        choices = data["choices"]
        assert len(choices) == 2 and {choice["index"] for choice in choices} == {0, 1}
        assert all(choice["message"]["content"] for choice in choices)
        assert data["object"] == "chat.completion" and data["prompt_token_ids"] is None
        usage = data["usage"]
        for choice, messages in zip(choices, (ALPHA, BETA), strict=True):
            single = http.post(
                "/v1/chat/completions", json={"messages": messages, "temperature": 0, **LETTERS}
            ).json()
            assert choice["message"] == single["choices"][0]["message"]
            usage["prompt_tokens"] -= single["usage"]["prompt_tokens"]
            usage["completion_tokens"] -= single["usage"]["completion_tokens"]
        assert usage["prompt_tokens"] == usage["completion_tokens"] == 0


def test_batched_chat_completions_with_json_schema(live: Live) -> None:
    """test_batched_chat_completions_with_json_schema: the schema holds for each."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    with live.client() as http:
        data = _batch(http, messages=[ALPHA, BETA], response_format=fmt, max_tokens=40)
    for choice in data["choices"]:
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")


def test_batched_chat_completions_logprobs_and_token_ids(live: Live) -> None:
    """test_batched_chat_completions_logprobs_not_token_id_placeholders,
    ..._return_tokens_as_token_ids and ..._logprob_token_ids."""
    call: dict[str, Any] = {"messages": [ALPHA], "logprobs": True, "top_logprobs": 1, **LETTERS}
    with live.client() as http:
        data = _batch(http, return_token_ids=True, **call)
        choice = data["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == 4
        for entry in choice["logprobs"]["content"]:
            assert not entry["token"].startswith("token_id:")
            assert not any(top["token"].startswith("token_id:") for top in entry["top_logprobs"])
        data = _batch(http, return_tokens_as_token_ids=True, **call)
        content = data["choices"][0]["logprobs"]["content"]
        assert content and all(entry["token"].startswith("token_id:") for entry in content)
        pinned = {"logprob_token_ids": [100, 150, 200], "return_tokens_as_token_ids": True}
        data = _batch(http, **{**call, "top_logprobs": 5, "max_tokens": 1, **pinned})
        first = data["choices"][0]["logprobs"]["content"][0]
        tokens = {entry["token"] for entry in first["top_logprobs"]}
        assert tokens == {"token_id:100", "token_id:150", "token_id:200", first["token"]}


def test_echo_begins_each_answer_with_its_own_assistant_turn(live: Live) -> None:
    """test_batched_echo_prepends_matching_assistant_prefix and
    test_batched_echo_does_not_prepend_user_prompt, on the server."""
    prefixed = [*ALPHA, {"role": "assistant", "content": "PREFIX "}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    with live.client() as http:
        data = _batch(http, messages=[prefixed, prefixed], echo=True, **continued, **LETTERS)
        assert all(c["message"]["content"].startswith("PREFIX ") for c in data["choices"])
        data = _batch(http, messages=[ALPHA, BETA], echo=True, **LETTERS)
        assert not any("Reply" in c["message"]["content"] for c in data["choices"])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_beam_search", True),
        ("n", 2),
        ("stream", True),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "auto"),
        ("prompt_logprobs", 1),
        ("messages", []),
        ("messages", [[]]),
    ],
)
def test_what_a_batch_refuses(live: Live, field: str, value: Any) -> None:
    """vLLM's limits, each a 400 naming its field; the server serves on."""
    body = {"model": MODEL, "messages": [ALPHA], field: value}
    with live.client() as http:
        refused = http.post("/v1/chat/completions/batch", json=body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"].startswith(field), refused.text
        assert _batch(http, messages=[BETA], max_tokens=1)["choices"]
