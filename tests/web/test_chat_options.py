"""vLLM's chat rendering options on the real server, through `/tokenize` and
`/v1/chat/completions`: `chat_template_kwargs` reach the template, no generation
prompt, a prompt that ends inside the final assistant message, and 400s naming the
field for what cannot hold. The model is a copy of the bundled one whose template
reads an `enable_thinking` variable, as Qwen3's does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Live, bundled_with_template, running_server, sse_events

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking %} <think>{% endif %}"
    "{% endif %}"
)
USER = [{"role": "user", "content": "What is two and two?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundled_with_template(tmp_path_factory.mktemp("thinking"), TEMPLATE)


@pytest.fixture
def served(backend: str, tmp_path: Path, thinking_model: Path) -> Iterator[Live]:
    with running_server(backend, tmp_path, model=str(thinking_model)) as live:
        yield live


def rendered(live: Live, **body: object) -> str:
    with live.client() as http:
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_the_options_shape_the_prompt(served: Live) -> None:
    plain = rendered(served, messages=USER)
    assert plain.endswith("What is two and two?\nassistant:")
    thinking = rendered(served, messages=USER, chat_template_kwargs={"enable_thinking": True})
    assert thinking == plain + " <think>"
    bare = rendered(served, messages=USER, add_generation_prompt=False)
    assert bare == plain.removesuffix("assistant:")
    started = [*USER, {"role": "assistant", "content": "The answer is"}]
    continued = rendered(served, messages=started, continue_final_message=True)
    assert continued.endswith("assistant: The answer is")
    with served.client() as http:
        count = http.post("/tokenize", json={"messages": started, "continue_final_message": True})
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": started, "continue_final_message": True, "max_tokens": 2},
        ).json()
        assert chat["usage"]["prompt_tokens"] == count.json()["count"]
        thinking_chat = http.post(
            "/v1/chat/completions",
            json={
                "messages": USER,
                "chat_template_kwargs": {"enable_thinking": True},
                "max_tokens": 1,
            },
        ).json()
        plain_count = http.post("/tokenize", json={"messages": USER}).json()["count"]
        assert thinking_chat["usage"]["prompt_tokens"] > plain_count


def test_what_cannot_hold_is_refused_by_name(served: Live) -> None:
    started = [*USER, {"role": "assistant", "content": "The answer is"}]
    cases = [
        (
            {"messages": started, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
        ({"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": USER, "chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
    ]
    with served.client() as http:
        for body, param in cases:
            for path in ("/tokenize", "/v1/chat/completions"):
                response = http.post(path, json={**body, "max_tokens": 1} if "v1" in path else body)
                assert response.status_code == 400, (path, body, response.text)
                assert response.json()["error"]["param"] == param, response.text


def test_echo_begins_the_answer_with_the_assistants_last_message(served: Live) -> None:
    """vLLM's `echo` on chat: continuing the assistant's message, the answer holds it
    first, whole and streamed; after a user's message there is nothing to echo."""
    started = [*USER, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": started, "continue_final_message": True, "max_tokens": 6}
    greedy = {"temperature": 0, "ignore_eos": True}
    with served.client() as http:
        plain = http.post("/v1/chat/completions", json={**body, **greedy}).json()
        echoed = http.post("/v1/chat/completions", json={**body, **greedy, "echo": True}).json()
        generated = plain["choices"][0]["message"]["content"]
        assert echoed["choices"][0]["message"]["content"] == "The answer is" + generated
        # The echo is no output token (the same counts; its prompt found cached).
        counted = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [echoed["usage"][k] for k in counted] == [plain["usage"][k] for k in counted]
        stream = http.post(
            "/v1/chat/completions", json={**body, **greedy, "echo": True, "stream": True}
        )
        chunks = [e for e in sse_events(stream.text.splitlines()) if e != "[DONE]"]
        first = chunks[0]["choices"][0]["delta"]
        assert first == {"role": "assistant", "content": "The answer is"}
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == "The answer is" + generated
        after_user = http.post(
            "/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "echo": True, **greedy}
        ).json()
        alone = http.post(
            "/v1/chat/completions", json={"messages": USER, "max_tokens": 3, **greedy}
        ).json()
        assert after_user["choices"][0]["message"] == alone["choices"][0]["message"]
        tool = {"type": "function", "function": {"name": "f"}}
        refused = http.post("/v1/chat/completions", json={**body, "echo": True, "tools": [tool]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
