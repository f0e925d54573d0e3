"""`kvscope serve`'s event loop thread runs real-time where the OS allows it and it is
asked to (`kvscope.scheduling`), leaves the policy while the loop is busy and takes it
back once it is calm; without the privilege, or with `--loop-priority 0`, it serves
as before, on short slices, and its log says why."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvscope.scheduling import LOOP_SLICE, current_slice
from tests.conftest import skip_without_realtime, thread_policy, without_realtime

from .conftest import BACKENDS, serve_cli


def _stop(process: Any) -> str:
    """SIGTERM, then the server's log once it exited 0."""
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    return stderr


def _poll(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("why", ["unprivileged", "not asked"])
def test_without_the_policy_the_loop_serves_on_short_slices_and_says_why(why: str) -> None:
    unprivileged = why == "unprivileged"
    process, url = serve_cli(
        "asyncio",
        "--worker",
        "thread",
        *([] if unprivileged else ["--loop-priority", "0"]),
        preexec_fn=without_realtime if unprivileged else None,
    )
    try:
        body = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        assert thread_policy(process.pid) == os.SCHED_OTHER
        if current_slice() is not None:
            assert current_slice(process.pid) == LOOP_SLICE
        stderr = _stop(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if unprivileged:
        assert "event loop thread: no real-time priority (sched_setscheduler failed" in stderr
    else:
        assert "real-time priority" not in stderr


def _read_response(connection: socket.socket) -> bytes:
    """One response (its head and its `content-length` of body) off `connection`."""
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer) < _length(answer):
        data = connection.recv(1 << 16)
        assert data, "the server closed a connection"
        answer += data
    return answer


def _length(answer: bytes) -> int:
    """The whole response's length, from its head."""
    head, _, _ = answer.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.lower().split(b"\r\n")[1:] if b":" in line)
    return len(head) + 4 + int(fields[b"content-length"])


def _flood(port: int, stop: threading.Event) -> None:
    """Keep the server's loop busy: 16 keep-alive connections, each with a `GET
    /health` always in flight (raw sockets: a light client, so the loop is the one
    busy)."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    try:
        while not stop.is_set():
            for connection in connections:
                connection.sendall(request)
            for connection in connections:
                assert _read_response(connection).startswith(b"HTTP/1.1 200")
    finally:
        for connection in connections:
            connection.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_busy_loop_leaves_the_real_time_policy_and_takes_it_back_once_calm(
    backend: str,
) -> None:
    skip_without_realtime()
    process, url = serve_cli(backend, "--worker", "thread")
    stop = threading.Event()
    errors: list[BaseException] = []

    def flood() -> None:
        try:
            _flood(int(url.rsplit(":", 1)[1]), stop)
        except BaseException as error:  # reported below
            errors.append(error)

    clients = [threading.Thread(target=flood) for _ in range(2)]
    try:
        assert thread_policy(process.pid) == os.SCHED_FIFO
        for client in clients:
            client.start()
        _poll(
            lambda: bool(errors) or thread_policy(process.pid) == os.SCHED_OTHER,
            "still real-time",
        )
        assert not errors, errors
        stop.set()
        for client in clients:
            client.join(60)
        assert not errors, errors
        _poll(lambda: thread_policy(process.pid) == os.SCHED_FIFO, "not real-time again")
        stderr = _stop(process)
    finally:
        stop.set()
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = [line for line in stderr.splitlines() if "event loop thread:" in line]
    assert "off the real-time policy until under 25%" in lines[-2], lines
    assert lines[-1].endswith("real-time priority 1 again"), lines
