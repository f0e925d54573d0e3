"""`RawHttp`, the benchmarks' hand-written client for a timed request: kept-alive
sockets, a new one when the server closed an idle one, and each round trip stamped in
the process that made it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import anyio
import pytest

from kvscope.bench.core.http import RawHttp

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.fixture
def closing_server() -> Iterator[tuple[str, list[int]]]:
    """A raw HTTP/1.1 server on 127.0.0.1 that answers one request per connection and
    then closes it, as a server does with a kept-alive connection left idle; yields its
    URL and how many requests each accepted connection carried."""
    listener = socket.create_server(("127.0.0.1", 0))
    served: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                conn.sendall(ANSWER)
                served.append(data.count(b"HTTP/1.1\r\n"))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", served
    listener.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept(); close alone does not
    listener.close()
    thread.join(timeout=10)


def test_a_closed_idle_socket_is_replaced_and_each_trip_is_stamped(
    closing_server: tuple[str, list[int]],
) -> None:
    url, served = closing_server

    async def three() -> list:
        async with RawHttp(url) as client:
            return [await client.request("DELETE", "/requests/x") for _ in range(3)]

    before = time.time()
    replies = anyio.run(three)
    assert [(r.status, r.body) for r in replies] == [(200, b"ok")] * 3
    # The server closed every connection after one answer: each later request found its
    # kept-alive socket dead and went out again on a new one, once.
    assert served == [1, 1, 1]
    for reply in replies:
        assert before <= reply.sent_wall <= time.time() and reply.rtt > 0


def test_a_silent_server_fails_the_request_in_time() -> None:
    """A server that accepts and never answers: the request fails after `timeout`
    instead of holding the benchmark's run for good."""
    listener = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody reads
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def one() -> None:
        async with RawHttp(url, timeout=0.5) as client:
            await client.request("DELETE", "/requests/x")

    try:
        with pytest.raises(TimeoutError):
            anyio.run(one)
    finally:
        listener.close()
