"""The fast path's requests answered off the wire (`web/asgi/wire.py`): over one kept-alive
raw socket, the requests it takes and those it leaves to hypercorn follow each other
and each gets the answer it would get from the routes; it never takes a request it
should leave (a partial head, two heads at once, HTTP/1.0, a body, `Connection: close`);
a refusal closes the connection. httpx's requests, which say `Connection: keep-alive`,
are taken too, so the suite's other DELETE tests (their audit lines, the blocks
released) go this way. Both anyio backends."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from kvscope.web.asgi import wire

from .conftest import LONG, Live, running_server, wait_clean, wait_tokens

pytestmark = pytest.mark.timeout(120)


class Connection:
    """One kept-alive HTTP/1.1 connection, written and read by hand."""

    def __init__(self, live: Live) -> None:
        host, port = live.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=20)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> tuple[int, dict[str, str], Any]:
        """The next answer: status, headers, JSON body."""
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self._read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, json.loads(body) if body else None

    def closed_by_server(self) -> bool:
        """True where the server closed the connection after its last answer: a request
        sent now is never read (an open connection would answer it at once)."""
        try:
            self.sock.sendall(request("GET", "/health"))
            return self.buffer == b"" and self.sock.recv(1) == b""
        except ConnectionError:  # reset: the server had closed
            return True

    def _read(self) -> None:
        data = self.sock.recv(65536)
        assert data, "the server closed the connection"
        self.buffer += data

    def close(self) -> None:
        self.sock.close()


def request(method: str, path: str, *headers: str, body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_the_installed_hypercorn_is_one_the_wire_patch_was_written_against() -> None:
    # A new hypercorn fails here: read `H11Protocol.handle` and the fields in
    # `wire.PROTOCOL_FIELDS` against it, then add its minor release to WRITTEN_AGAINST.
    from importlib import metadata

    installed = metadata.version("hypercorn")
    assert wire.written_against(installed), (installed, wire.WRITTEN_AGAINST)
    assert wire.install()
    assert not wire.written_against("0.19.0")
    assert not wire.written_against("1.17.0")


def test_parse_head_takes_one_plain_bodiless_head_only() -> None:
    plain = request("DELETE", "/requests/req-1", "user-agent: raw", "content-length: 0")
    assert wire.parse_head(plain) == (
        "DELETE",
        b"/requests/req-1",
        [(b"host", b"127.0.0.1"), (b"user-agent", b"raw"), (b"content-length", b"0")],
    )
    assert wire.parse_head(request("GET", "/stats?x=1", "Authorization: Bearer k")) == (
        "GET",
        b"/stats?x=1",
        [(b"host", b"127.0.0.1"), (b"authorization", b"Bearer k")],
    )
    # HTTP/1.1's default, sent by httpx, the openai package and requests: taken
    assert wire.parse_head(request("GET", "/health", "Connection: Keep-Alive")) == (
        "GET",
        b"/health",
        [(b"host", b"127.0.0.1"), (b"connection", b"Keep-Alive")],
    )
    for declined in (
        plain[:-2],  # a partial head
        plain + plain,  # two at once
        plain.replace(b"HTTP/1.1", b"HTTP/1.0"),
        request("DELETE", "/requests/r", "content-length: 2", body=b"{}"),
        request("DELETE", "/requests/r", "transfer-encoding: chunked"),
        request("DELETE", "/requests/r", "connection: close"),
        request("DELETE", "/requests/r", "connection: keep-alive, upgrade"),
        request("GET", "/health", "upgrade: websocket"),
        request("GET", "/health", "expect: 100-continue"),
        request("POST", "/generate"),
        request("GET", "/stats", "x-bad header: 1"),
        request("GET", "/st\xe4ts"),
        b"GET /stats HTTP/1.1\r\n\r\n",  # no Host: h11 answers 400
        request("GET", "/stats", "host: 127.0.0.1"),  # two
    ):
        assert wire.parse_head(declined) is None, declined
    # a long header line that fails at its end is refused in linear time (a pattern
    # with overlapping repeats takes minutes on it: the timeout fails it)
    assert wire.parse_head(request("GET", "/stats", "x:" + " " * 400_000 + "\x7f")) is None


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_taken_and_left_requests_share_one_connection(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path) as live:
        conn = Connection(live)
        try:
            conn.send(request("DELETE", "/requests/nobody"))
            status, headers, body = conn.answer()
            assert status == 404 and body["error"]["type"] == "not_found_error"
            assert headers["content-type"] == "application/json"
            assert "date" in headers and headers["server"].startswith("hypercorn")

            conn.send(request("GET", "/health"))
            status, _, body = conn.answer()
            assert status == 200 and body["status"] == "ok"

            # a request with a body goes to hypercorn and Quart, on the same connection
            payload = json.dumps({"prompt": "hello", **LONG}).encode()
            conn.send(
                request(
                    "POST",
                    "/generate",
                    "content-type: application/json",
                    f"content-length: {len(payload)}",
                    body=payload,
                )
            )
            status, _, body = conn.answer()
            assert status == 202
            request_id = body["id"]
            with live.client() as client:
                wait_tokens(client, request_id)

            # the head in two pieces: hypercorn reassembles it
            head = request("GET", "/stats")
            conn.send(head[:9])
            conn.send(head[9:])
            status, _, body = conn.answer()
            assert status == 200 and body["live_requests"] == 1

            conn.send(request("DELETE", f"/requests/{request_id}"))
            status, _, body = conn.answer()
            assert status == 200 and body["found"] and body["status"] == "running"
            assert body["blocks_released"] >= 1

            # two heads in one packet: hypercorn answers both, in order
            conn.send(request("DELETE", f"/requests/{request_id}") + request("GET", "/health"))
            status, _, body = conn.answer()
            assert status == 409 and body["error"]["status"] == "cancelled"
            status, _, body = conn.answer()
            assert status == 200 and body["ready"]

            conn.send(request("GET", "/stats"))
            status, _, body = conn.answer()
            assert status == 200 and body["kv_blocks_in_use"] == 0
            assert body["live_requests"] == 0

            conn.send(request("GET", "/health", "connection: close"))
            status, headers, _ = conn.answer()
            assert status == 200 and headers["connection"] == "close"
            assert conn.closed_by_server()
        finally:
            conn.close()
        wait_clean(live)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_refused_delete_closes_the_connection(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path, api_keys=("k1",)) as live:
        with live.client("k1") as client:
            request_id = client.post("/generate", json={"prompt": "hi", **LONG}).json()["id"]
            wait_tokens(client, request_id)
        conn = Connection(live)
        try:
            conn.send(request("DELETE", f"/requests/{request_id}"))
            status, headers, body = conn.answer()
            assert status == 401 and body["error"]["type"] == "authentication_error"
            assert headers["connection"] == "close"
            assert conn.closed_by_server()
        finally:
            conn.close()
        conn = Connection(live)
        try:
            conn.send(request("DELETE", f"/requests/{request_id}", "authorization: Bearer k1"))
            status, _, body = conn.answer()
            assert status == 200 and body["found"]
        finally:
            conn.close()
        wait_clean(live)
