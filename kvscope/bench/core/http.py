"""The HTTP client side every benchmark shares: a light `aiohttp` session, readiness
polling, and the client's own CPU seconds.

The client shares the machine's cores with the server it measures, so it is light:
`aiohttp` (not httpx, which was heavy enough to halve a peer's figure), one JSON parse
per SSE event, and its own CPU seconds reported with every run (`CpuClock`). Only ever
pointed at 127.0.0.1. aiohttp runs on asyncio only: the benchmarks drive it with
`anyio.run`'s default backend.

Requests whose round trip is itself the figure (`bench cancel`'s DELETE) go through
`RawHttp` instead: HTTP/1.1 written and read by hand on kept-alive sockets, so the
figure is the server's and not the client library's (against a raw asyncio server on
this machine, a request took 1.06 ms p50 through aiohttp and 0.29 ms on a raw socket).
Each exchange runs on a worker thread, which stamps it: the round trip does not wait
for the client's event loop, busy with the streams it reads (that loop's own lag was
p99 2-3 ms in `bench cancel`; with the DELETE on it the round trip read p50 / p99
3.6 / 8.5 ms where the thread reads 2.5 / 4.0 ms, one run each).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from urllib.parse import urlsplit

import aiohttp
import anyio
import attrs

from .workload import Deadline


def check_local(base_url: str) -> None:
    host = urlsplit(base_url).hostname
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"benchmarks only send traffic to 127.0.0.1, not {host}")


async def served_model(base_url: str) -> str:
    """The model id the server at `base_url` answers to (its `GET /v1/models`): an
    OpenAI-compatible server refuses any other name."""
    async with (
        aiohttp.ClientSession(base_url, timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get("/v1/models") as response,
    ):
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def wait_ready(base_url: str, path: str, timeout: float, alive=lambda: True) -> None:
    """Poll `path` until it answers 200, the process dies, or `timeout` s pass."""
    deadline = Deadline(timeout)
    async with aiohttp.ClientSession(base_url, timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not deadline.passed:
            if not alive():
                raise RuntimeError(f"the server at {base_url} exited while starting")
            try:
                async with session.get(path) as response:
                    if response.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await anyio.sleep(0.1)
    raise TimeoutError(f"{base_url}{path} was not ready after {timeout:.0f} s")


def session(base_url: str, *, timeout: float, connections: int = 100) -> aiohttp.ClientSession:
    """A session for `base_url` (127.0.0.1 only) with room for `connections` at once."""
    check_local(base_url)
    return aiohttp.ClientSession(
        base_url,
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=timeout),
    )


class CpuClock:
    """This process's CPU seconds and wall seconds since it was made (the benchmark's
    client runs nothing else meanwhile), and their share of the machine."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    @property
    def wall(self) -> float:
        return time.perf_counter() - self.wall0

    @property
    def cpu(self) -> float:
        return time.process_time() - self.cpu0

    def share(self) -> float:
        return self.cpu / (max(self.wall, 1e-9) * (os.cpu_count() or 1))


@attrs.frozen
class RawReply:
    status: int
    body: bytes
    #: When the request was written (`time.time()`) and its round trip (s), stamped on
    #: the thread that wrote it and read the answer.
    sent_wall: float
    rtt: float


class _Stale(ConnectionError):
    """A kept-alive socket the server closed while it was idle."""


class RawHttp:
    """Bodiless requests (`DELETE`, `GET`) on kept-alive blocking sockets, each on a
    worker thread (see the module docstring), read by hand: the answer must have a
    `content-length` (kvscope's and most JSON answers do). One socket per request in
    flight; idle ones are reused. A server silent for `timeout` s fails the request
    (`TimeoutError`); a cancelled caller does not wait for the thread."""

    def __init__(self, base_url: str, timeout: float = 30.0) -> None:
        check_local(base_url)
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.timeout = timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    async def request(self, method: str, path: str) -> RawReply:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: 0\r\n\r\n"
        return await anyio.to_thread.run_sync(self._request, head.encode(), abandon_on_cancel=True)

    def _request(self, head: bytes) -> RawReply:
        while (sock := self._take_idle()) is not None:
            try:
                return self._exchange(sock, head)
            except ConnectionError:
                continue  # closed by the server while idle: the request never reached it
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._exchange(sock, head)

    def _take_idle(self) -> socket.socket | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _exchange(self, sock: socket.socket, head: bytes) -> RawReply:
        try:
            sent_wall, sent = time.time(), time.perf_counter()
            sock.sendall(head)
            status, body, keep = _read_reply(sock)
            rtt = time.perf_counter() - sent
        except BaseException:
            sock.close()
            raise
        if keep:
            with self._lock:
                self._idle.append(sock)
        else:
            sock.close()
        return RawReply(status, body, sent_wall, rtt)

    async def aclose(self) -> None:
        with self._lock:
            for sock in self._idle:
                sock.close()
            self._idle.clear()


def _read_reply(sock: socket.socket) -> tuple[int, bytes, bool]:
    """One response: the status, the body (by `content-length`), and whether the
    connection stays open."""

    def more() -> bytes:
        chunk = sock.recv(65536)
        if not chunk:
            raise _Stale("the server closed the connection")
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    length = int(headers.get("content-length", "-1"))
    if length < 0:
        raise ValueError("RawHttp reads answers with a content-length only")
    while len(body) < length:
        body += more()
    return status, body[:length], headers.get("connection") != "close"
