"""`POST /v1/embeddings` on the real server, through the `openai` package and httpx:
each input's embedding (normalized, the same from text and from its token ids, in
floats and in base64), `dimensions`, usage, the 400s naming the field, and the end of
life: leaving before the answer cancels every input's request, a DELETE cancels one
(409), and no block is left."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import Live, serve_cli, wait_clean, wait_for, wait_status

HIDDEN = 64  # the tiny-random model's hidden size


def norm(vector: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def test_each_input_gets_its_embedding(live: Live, client: openai.OpenAI) -> None:
    texts = ["a cache of keys and values", "hello"]
    out = client.embeddings.create(model="tiny-random", input=texts)  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1] and out.model == "tiny-random"
    vectors = [d.embedding for d in out.data]
    assert all(len(v) == HIDDEN and norm(v) == pytest.approx(1, abs=1e-5) for v in vectors)
    assert vectors[0] != vectors[1]
    with live.client() as http:
        ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
        floats = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"})
        assert floats.status_code == 200, floats.text
        body = floats.json()
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        for got, sent in zip(body["data"], vectors, strict=True):
            assert got["embedding"] == pytest.approx(sent, abs=1e-5)
        from_ids = http.post("/v1/embeddings", json={"input": ids[0]}).json()
        assert from_ids["data"][0]["embedding"] == pytest.approx(vectors[0], abs=1e-5)
        answer = http.post("/v1/embeddings", json={"input": texts[0]})
        assert answer.headers["X-Request-Id"] == answer.json()["id"].removeprefix("embd-")
        record = live.audit_record(answer.headers["X-Request-Id"])
        assert record["finish_reason"] == "stop" and record["generated_tokens"] == 0
    short = client.embeddings.create(model="tiny-random", input=texts[0], dimensions=8)
    head = vectors[0][:8]
    assert short.data[0].embedding == pytest.approx([x / norm(head) for x in head], abs=1e-5)
    wait_clean(live)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [10**9]}, "input"),  # a token id past the vocabulary (the engine says)
        ({"input": "past the context"}, "input"),
        ({"input": "a", "dimensions": HIDDEN + 1}, "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "messages": []}, "messages"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(
    live: Live, body: dict[str, Any], param: str | None
) -> None:
    with live.client() as http:
        if body["input"] == "past the context":
            length = http.get("/v1/models").json()["data"][0]["max_model_len"]
            body = {"input": [5] * (length + 1)}
        answer = http.post("/v1/embeddings", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, error
        unknown = http.post("/v1/embeddings", json={"input": "a", "model": "other"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    wait_clean(live)


def _held(live: Live) -> tuple[threading.Event, threading.Event]:
    """The next forward, held until the first event is set (the second says it began)."""
    release, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(30)

    engine = live.server.engine
    assert engine is not None
    live.portal.call(engine.before_forward.append, hold)
    return release, entered


def _live_ids(live: Live, count: int) -> list[str]:
    with live.client() as http:
        return wait_for(
            lambda: (
                [r["id"] for r in http.get("/requests").json()["requests"]]
                if len(http.get("/requests").json()["requests"]) == count
                else None
            ),
            what=f"{count} live requests",
        )


def test_leaving_before_the_answer_cancels_every_input(live: Live) -> None:
    release, entered = _held(live)
    failed: list[BaseException] = []

    def call() -> None:
        try:
            httpx.post(
                live.url + "/v1/embeddings",
                json={"input": ["one input", "another input"]},
                timeout=httpx.Timeout(30, read=0.5),
            )
        except httpx.ReadTimeout as exc:  # the client gives up and closes the connection
            failed.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert entered.wait(30)
        ids = _live_ids(live, 2)
        caller.join(30)
        assert failed
        for request_id in ids:
            assert live.audit_record(request_id)["cancel_reason"] == "disconnect"
    finally:
        release.set()
        caller.join(30)
    wait_clean(live)


def test_a_delete_cancels_one_input_and_the_call_says_so(live: Live) -> None:
    release, entered = _held(live)
    answers: list[httpx.Response] = []
    caller = threading.Thread(
        target=lambda: answers.append(
            httpx.post(live.url + "/v1/embeddings", json={"input": ["one", "two"]}, timeout=30)
        )
    )
    caller.start()
    try:
        assert entered.wait(30)
        gone = _live_ids(live, 2)[0]
        with live.client() as http:
            report = http.delete(f"/requests/{gone}").json()
        assert report["blocks_released"] > 0
    finally:
        release.set()
        caller.join(30)
    (answer,) = answers
    assert answer.status_code == 409, answer.text
    assert gone in answer.json()["error"]["message"] and "cancelled" in answer.text
    wait_clean(live)


def test_the_native_api_answers_an_embedding_too(live: Live) -> None:
    with live.client() as http:
        job = http.post("/generate", json={"prompt": "a cache of keys", "embed": True})
        assert job.status_code == 202, job.text
        info = wait_status(http, job.json()["id"])
        assert info["status"] == "finished" and info["tokens_generated"] == 0
        same = http.post("/v1/embeddings", json={"input": "a cache of keys"}).json()
        assert info["embedding"] == pytest.approx(same["data"][0]["embedding"], abs=1e-5)
        plain = http.post("/generate", json={"prompt": "a", "max_tokens": 1}).json()
        assert wait_status(http, plain["id"])["embedding"] is None
        mixed = http.post("/generate", json={"prompt": "a", "embed": True, "logprobs": 1})
        assert mixed.status_code == 400 and "embed" in mixed.json()["error"]["message"]
    wait_clean(live)


def test_an_embedding_model_is_served_for_embeddings_only(tmp_path: Path) -> None:
    """`kvscope serve` on a decoder saved alone without an output head (as embedding
    models are): its printed curl line asks for an embedding and works as printed;
    a completion is a 400 saying why."""
    pytest.importorskip("transformers")
    from tests.models.conftest import build_checkpoint

    model = build_checkpoint("qwen3", tmp_path / "embedder", decoder_alone=True)
    process, url = serve_cli("asyncio", str(model), "--worker", "thread", model=None)
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]  # the dashboard, a try line
        curl_line = lines[1].removeprefix("  try:       ").strip()
        assert "/v1/embeddings" in curl_line, lines
        if shutil.which("curl"):
            printed = subprocess.run(
                ["bash", "-c", curl_line], capture_output=True, text=True, timeout=60
            )
            assert printed.returncode == 0, printed.stderr
            assert len(json.loads(printed.stdout)["data"][0]["embedding"]) == HIDDEN
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert refused.status_code == 400 and "embeddings only" in refused.text
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=60)  # drained: a full pipe would block it
        assert process.returncode == 0, log[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_chat_is_embedded_as_its_template_renders_it(live: Live) -> None:
    """vLLM's chat embeddings: `messages` rendered by the chat template (the assistant's
    turn left closed unless asked), the same vector as the rendered tokens'."""
    chat = [{"role": "user", "content": "a cache of keys"}]
    with live.client() as http:
        for opens in (False, True):
            rendered = http.post(
                "/tokenize", json={"messages": chat, "add_generation_prompt": opens}
            ).json()["tokens"]
            body: dict[str, Any] = {"messages": chat}
            if opens:
                body["add_generation_prompt"] = True
            answer = http.post("/v1/embeddings", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] == len(rendered)
            tokens = http.post("/v1/embeddings", json={"input": rendered}).json()
            assert answer.json()["data"][0]["embedding"] == pytest.approx(
                tokens["data"][0]["embedding"], abs=1e-5
            )
        for body in ({}, {"input": "a", "messages": chat}):
            refused = http.post("/v1/embeddings", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    wait_clean(live)
