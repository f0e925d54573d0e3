"""What an adversarial client sends is refused with a 4xx (or an error event on a
WebSocket), never a 5xx, a closed socket or a stalled loop: invalid Unicode, requests
without a key, oversized bodies and prompts, costly sampling parameters."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import stat
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from kvscope import serve
from kvscope.web.serve import settings_from

from .conftest import Live, running_server, wait_clean, wait_for

#: JSON text with a lone surrogate escape: valid JSON and valid UTF-8, invalid Unicode.
LONE = "a\\ud800b"


def _post(client: httpx.Client, path: str, body: str) -> httpx.Response:
    return client.post(path, content=body.encode(), headers={"content-type": "application/json"})


def test_lone_surrogates_are_a_400_everywhere(live: Live) -> None:
    bodies = {
        "/generate": [
            f'{{"prompt": "{LONE}"}}',
            f'{{"prompt": "x", "stop": ["{LONE}"]}}',
            f'{{"prompt": "x", "stop": "{LONE}"}}',
        ],
        "/v1/completions": [
            f'{{"prompt": "{LONE}"}}',
            f'{{"prompt": ["{LONE}"]}}',
            f'{{"prompt": "x", "stop": ["{LONE}"]}}',
        ],
        "/v1/chat/completions": [
            f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}',
            f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{LONE}"}}]}}]}}',
            f'{{"messages": [{{"role": "user", "content": "x"}}], "stop": "{LONE}"}}',
        ],
    }
    with live.client() as client:
        for path, cases in bodies.items():
            for body in cases:
                response = _post(client, path, body)
                assert response.status_code == 400, (path, body, response.text)
                assert "Unicode" in response.json()["error"]["message"], response.text
    with connect(live.ws_url + "/ws/generate") as ws:
        for body in bodies["/generate"]:
            ws.send(body)
            event = json.loads(ws.recv(timeout=30))
            assert event["type"] == "error", event
            assert event["error"]["type"] == "invalid_request_error"
        ws.send(json.dumps({"prompt": "still open", "max_tokens": 2}))
        assert json.loads(ws.recv(timeout=30))["type"] == "start"
        while json.loads(ws.recv(timeout=30))["type"] != "done":
            pass
    wait_clean(live)


def test_stop_string_caps(live: Live) -> None:
    with live.client() as client:
        for stop in (["s"] * 17, ["x" * 257]):
            for path in ("/generate", "/v1/completions"):
                response = client.post(path, json={"prompt": "x", "stop": stop})
                assert response.status_code == 400, response.text
                assert "stop" in response.json()["error"]["message"]
        ok = client.post("/generate", json={"prompt": "x", "stop": ["s"] * 16, "max_tokens": 1})
        assert ok.status_code == 202
    wait_clean(live)


def test_a_prompt_over_max_prompt_bytes_is_refused_before_tokenizing(
    backend: str, tmp_path: Path
) -> None:
    with running_server(backend, tmp_path, max_prompt_bytes=1000) as live, live.client() as client:
        for path, body in (
            ("/generate", {"prompt": "é" * 501}),
            ("/v1/completions", {"prompt": "x" * 1001}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1001}]}),
        ):
            response = client.post(path, json=body)
            assert response.status_code == 400, response.text
            assert "max_prompt_bytes" in response.json()["error"]["message"]
        assert (
            client.post("/generate", json={"prompt": "x" * 900, "max_tokens": 1}).status_code == 202
        )
        wait_clean(live)


def _raw_exchange(live: Live, head: str, timeout: float = 10.0) -> bytes:
    """Send only a request's head, then read what the server answers until it closes."""
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode("latin-1"))
        received = b""
        while chunk := sock.recv(65536):  # ends when the server closes the connection
            received += chunk
        return received


def test_refusals_come_before_the_body_is_read(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a key (or past the body cap), the answer comes from the head alone, and
    the connection closes: the body is never waited for. A WebSocket refused for its key
    is a 401, with nothing logged as an error."""
    with running_server(backend, tmp_path, api_keys=("alpha",)) as live:
        big = 1 << 20
        head = "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}Content-Length: {length}\r\n\r\n"
        for path in ("/generate", "/v1/completions", "/requests/req-x"):
            answer = _raw_exchange(live, head.format(path=path, extra="", length=big))
            assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
            assert b"www-authenticate: Bearer" in answer.lower().replace(b"bearer", b"Bearer")
        keyed = "Authorization: Bearer alpha\r\n"
        answer = _raw_exchange(live, head.format(path="/generate", extra=keyed, length=big + 1))
        assert answer.startswith(b"HTTP/1.1 413 ") and b"max_body_bytes" in answer, answer[:200]
        with pytest.raises(InvalidStatus) as refused:
            with connect(live.ws_url + "/ws/generate"):
                pass
        assert refused.value.response.status_code == 401
        with live.client("alpha") as client:  # and the server serves on
            assert (
                client.post("/generate", json={"prompt": "x", "max_tokens": 1}).status_code == 202
            )
            wait_clean(live)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


def test_keys_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    key_file = tmp_path / "keys"
    key_file.write_text("# the team's keys\nalpha\n\n  beta  \n")
    monkeypatch.setenv("KVSCOPE_API_KEY", "gamma")
    settings = settings_from(parser.parse_args(["--api-key-file", str(key_file)]))
    assert sorted(settings.api_keys.values()) == ["alpha", "beta", "gamma"]
    monkeypatch.delenv("KVSCOPE_API_KEY")
    monkeypatch.setenv("KVSCOPE_API_KEY_FILE", str(key_file))
    assert len(settings_from(parser.parse_args([])).api_keys) == 2
    key_file.write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        settings_from(parser.parse_args([]))


def test_the_audit_log_is_readable_by_its_owner_only(live: Live) -> None:
    with live.client() as client:
        client.post("/generate", json={"prompt": "x", "max_tokens": 1})
        wait_clean(live)
    wait_for(live.audit, what="an audit line")
    assert stat.S_IMODE(live.audit_path.stat().st_mode) == 0o600
