"""vLLM's `--root-path`: `kvscope serve --root-path /llm` answers `/llm/v1/...` as it
answers `/v1/...` (a proxy that keeps the prefix), the API key checked under both, the
asserts of vLLM's chat_completion/test_root_path.py through the `openai` client, and a
cancel by `DELETE /llm/requests/{id}` freeing the request's blocks."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvscope.web.asgi.root_path import checked_root_path

from .conftest import LONG, served, wait_tokens

KEY = "abc-123"


@pytest.mark.parametrize("prefix", [["v1"], ["llm", "v1"]])
def test_both_paths_answer_with_the_key_and_refuse_without(backend: str, prefix: list[str]) -> None:
    with served(backend, "--root-path", "/llm", "--api-key", KEY) as url:
        base = "/".join([url, *prefix])
        client = openai.OpenAI(api_key=KEY, base_url=base, max_retries=0)
        answer = client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].message.content is not None
        assert client.models.list().data[0].id == "tiny-random"
        wrong = openai.OpenAI(api_key="abc", base_url=base, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


def test_a_request_is_cancelled_under_the_prefix(backend: str) -> None:
    with served(backend, "--root-path", "/llm/") as url, httpx.Client(base_url=url) as http:
        job = http.post("/llm/generate", json={"prompt": "a", **LONG}).json()
        wait_tokens(http, job["id"])
        report = http.delete(f"/llm/requests/{job['id']}").json()
        assert report["found"] and report["blocks_released"] >= 1
        assert http.get(f"/llm/requests/{job['id']}").json()["status"] == "cancelled"
        assert http.get("/stats").json()["kv_blocks_in_use"] == 0
        assert http.get("/llmx/v1/models").status_code == 404  # a prefix is a whole segment


def test_a_root_path_must_start_with_a_slash() -> None:
    assert checked_root_path("/llm/") == "/llm" and checked_root_path("") == ""
    with pytest.raises(ValueError, match="must start with"):
        checked_root_path("llm")
