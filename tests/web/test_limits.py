"""Limits and bad input: 429 with Retry-After, 413, 400s, and never a 5xx or a hang."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvscope import EngineConfig

from .conftest import LONG, Live, running_server, wait_clean, wait_status


def test_queue_cap_answers_429(backend: str, tmp_path: Path) -> None:
    with (
        running_server(backend, tmp_path, max_num_seqs=1, max_queued_requests=1) as live,
        live.client() as client,
    ):
        running = client.post("/generate", json={"prompt": "first", **LONG}).json()
        wait_status(client, running["id"], ("running",))
        queued = client.post("/generate", json={"prompt": "second", **LONG}).json()
        assert client.get(f"/requests/{queued['id']}").json()["status"] == "queued"
        refused = client.post("/generate", json={"prompt": "third", **LONG})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "overloaded_error"
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "x", "stream": True}
        ) as streamed:
            assert streamed.status_code == 429
        # cancelling a queued request frees its place
        report = client.delete(f"/requests/{queued['id']}").json()
        assert report["status"] == "queued"
        assert client.get(f"/requests/{queued['id']}").json()["cancel_reason"] == "user"
        client.delete(f"/requests/{running['id']}")
        wait_clean(live)


def test_context_limits(backend: str, tmp_path: Path) -> None:
    with (
        running_server(backend, tmp_path, max_model_len=64, max_body_bytes=4096) as live,
        live.client() as client,
    ):
        too_long = client.post("/generate", json={"prompt": "x" * 100})
        assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]
        capped = client.post(
            "/generate",
            json={"prompt": "12345", "max_tokens": 10**9, "ignore_eos": True, "temperature": 0},
        )
        assert capped.status_code == 202
        info = wait_status(client, capped.json()["id"])
        assert info["finish_reason"] == "length" and info["tokens_generated"] == 64 - 6
        big = client.post(
            "/generate",
            content=b'{"prompt": "' + b"a" * 5000 + b'"}',
            headers={"content-type": "application/json"},
        )
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        # the same client goes on working after a refused body (keep-alive or not)
        assert (
            client.post("/generate", json={"prompt": "after", "max_tokens": 1}).status_code == 202
        )
        wait_clean(live)


BAD_BODIES: list[bytes | str] = [
    b"",
    b"{",
    b"null",
    b"[]",
    b"42",
    b'"prompt"',
    b"\xff\xfe{}",
    '{"prompt": "\udcff"}'.encode("utf-8", "surrogatepass"),
    b"[" * 5000 + b"]" * 5000,
    b'{"prompt": "' + b"\xc3\x28" + b'"}',
    b'{"prompt": ""}',
    b'{"prompt_token_ids": []}',
    b'{"prompt": "x", "prompt_token_ids": [1]}',
    b"{}",
    b'{"prompt": 5}',
    b'{"prompt": ["a"]}',
    b'{"prompt": "x", "max_tokens": "5"}',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "max_tokens": 0}',
    b'{"prompt": "x", "max_tokens": 1e400}',
    b'{"prompt": "x", "max_tokens": 99999999999999999999999999}',
    b'{"prompt": "x", "temperature": -1}',
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "top_p": 0}',
    b'{"prompt": "x", "top_p": 2}',
    b'{"prompt": "x", "top_k": -3}',
    b'{"prompt": "x", "seed": -9223372036854775809}',  # any 64-bit integer is a seed
    b'{"prompt": "x", "seed": 100000000000000000000000}',
    b'{"prompt": "x", "stop": [""]}',
    b'{"prompt": "x", "stop": [1]}',
    b'{"prompt": "x", "stop_token_ids": [-1]}',
    b'{"prompt": "x", "ignore_eos": "yes"}',
    b'{"prompt": "x", "priority": 1.5}',
    b'{"prompt": "x", "priority": true}',
    b'{"prompt": "x", "timeout": 0}',
    b'{"prompt": "x", "timeout": 1e300}',
    b'{"prompt": "x", "parent": "req-unknown"}',
    b'{"prompt": "x", "bogus": 1}',
    b'{"prompt_token_ids": [999999]}',
    b'{"prompt_token_ids": [-5]}',
    b'{"prompt_token_ids": "abc"}',
    b'{"prompt": "x", "stream": "no"}',
]


def _check(response: httpx.Response, *, lenient: bool = False) -> None:
    """A 4xx with a JSON error; `lenient` (OpenAI routes ignore unknown fields): or a 200."""
    if lenient and response.status_code == 200:
        return
    assert 400 <= response.status_code < 500, (
        response.status_code,
        response.text,
        response.request.content[:80],
    )
    error = response.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)


def test_bad_input_is_a_4xx(live: Live) -> None:
    with live.client() as client:
        for body in BAD_BODIES:
            for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
                response = client.post(
                    path, content=body, headers={"content-type": "application/json"}
                )
                _check(response, lenient=path.startswith("/v1/"))
        for body in (
            b'{"prompt": "x", "n": 0}',
            b'{"prompt": "x", "n": 1000}',
            b'{"prompt": []}',  # a list of prompts is a batch (issue 14); an empty one is not
            b'{"prompt": [[1, 2], []]}',
            b'{"prompt": "x", "temperature": 3}',
        ):
            _check(
                client.post(
                    "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
            )
        for body in (
            b'{"messages": []}',
            b'{"messages": [{"role": "", "content": "x"}]}',
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            b'{"messages": "hi"}',
        ):
            _check(
                client.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
            )
        _check(client.post("/generate", data={"prompt": "form"}))
        _check(client.get("/requests/%ff%fe"))
        _check(client.delete("/requests/" + "x" * 3000))
        _check(client.put("/generate", json={}))
        _check(client.get("/no/such/route"))
        assert client.get("/stats").json()["live_requests"] == 0
    wait_clean(live)


def _chain(client: httpx.Client, depth: int) -> list[str]:
    ids = [client.post("/generate", json={"prompt": "root", **LONG}).json()["id"]]
    for _ in range(depth):
        response = client.post("/generate", json={"prompt": "c", "parent": ids[-1], **LONG})
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    return ids


def test_the_deepest_chain_cancels_by_delete_and_by_shutdown(backend: str, tmp_path: Path) -> None:
    """A parent chain as deep as `max_request_depth` allows: the next level is a 400
    naming the limit, a family past `max_family_size` a 429 naming it; DELETE of the
    root cancels the chain, and shutting down with a chain live ends it cleanly."""
    depth = EngineConfig().max_request_depth
    with running_server(backend, tmp_path, max_num_seqs=4, max_family_size=depth + 2) as live:
        with live.client() as client:
            ids = _chain(client, depth)
            too_deep = client.post("/generate", json={"prompt": "x", "parent": ids[-1], **LONG})
            assert too_deep.status_code == 400
            assert "max_request_depth" in too_deep.json()["error"]["message"]
            client.post("/generate", json={"prompt": "x", "parent": ids[0], **LONG})
            too_many = client.post("/generate", json={"prompt": "x", "parent": ids[0], **LONG})
            assert too_many.status_code == 429 and "retry-after" in too_many.headers
            assert "max_family_size" in too_many.json()["error"]["message"]
            report = client.delete(f"/requests/{ids[0]}")
            assert report.status_code == 200 and report.json()["cancelled_children"] == depth + 1
            wait_clean(live)
            assert all(client.get(f"/requests/{i}").json()["status"] == "cancelled" for i in ids)
            live_chain = _chain(client, depth)
        # the fixture's exit is the SIGTERM path: it shuts down with the chain live
    audit = live.audit()
    assert all(audit[i]["finish_reason"] == "cancelled" for i in ids + live_chain)
    lines = live.audit_path.read_text().splitlines()
    assert len(lines) == len(audit) == 2 * (depth + 1) + 1
