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
Each exchange is made and stamped in a process of its own (`raw_exchange`): the round
trip waits neither for the client's event loop, busy with the streams it reads (with
the DELETE on that loop the round trip read p50 / p99 3.6 / 8.5 ms where a thread read
2.5 / 4.0 ms, one run each), nor for that loop's GIL, which a thread of the same
process needs again as soon as the answer arrives.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio
import anyio.abc
import attrs
from anyio.streams.buffered import BufferedByteReceiveStream

from . import raw_exchange
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


async def wait_ready(
    base_url: str,
    path: str,
    timeout: float,
    alive: Callable[[], bool] = lambda: True,
    accept: Callable[[Any], bool] | None = None,
) -> None:
    """Poll `path` until it answers 200 (and, given `accept`, a JSON body it accepts),
    the process dies, or `timeout` s pass."""
    deadline = Deadline(timeout)
    async with aiohttp.ClientSession(base_url, timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not deadline.passed:
            if not alive():
                raise RuntimeError(f"the server at {base_url} exited while starting")
            try:
                async with session.get(path) as response:
                    if response.status == 200 and (accept is None or accept(await response.json())):
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
    #: When the request was written (`time.time()`) and its round trip (s), stamped in
    #: the process that wrote it and read the answer.
    sent_wall: float
    rtt: float


class RawHttp:
    """Bodiless requests (`DELETE`, `GET`) made by a process of its own
    (`raw_exchange`) on kept-alive blocking sockets, read by hand: the answer must have
    a `content-length` (kvscope's and most JSON answers do). A server silent for
    `timeout` s fails the request (`TimeoutError`); a cancelled caller does not wait
    for the answer. `async with RawHttp(url) as raw: await raw.request(...)`."""

    def __init__(self, base_url: str, timeout: float = 30.0) -> None:
        check_local(base_url)
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.timeout = timeout
        self._process: anyio.abc.Process | None = None
        self._waiting: dict[str, tuple[anyio.Event, list[dict[str, Any]]]] = {}
        self._ids = itertools.count()
        self._tasks: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> RawHttp:
        self._process = await anyio.open_process(
            # By path, not `-m`: the package's __init__ would import torch (seconds).
            [sys.executable, raw_exchange.__file__, self.host, str(self.port), str(self.timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        self._tasks.start_soon(self._read_answers)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        process, tasks = self._process, self._tasks
        assert process is not None and process.stdin is not None and tasks is not None
        with anyio.CancelScope(shield=True):
            await process.stdin.aclose()  # the child ends; so does _read_answers
            with anyio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
        # The reader has nothing left to read; the caller's own exception, if any,
        # goes on from its `async with` unwrapped.
        tasks.cancel_scope.cancel()
        await tasks.__aexit__(None, None, None)

    async def request(self, method: str, path: str) -> RawReply:
        assert self._process is not None and self._process.stdin is not None, "not entered"
        request_id = str(next(self._ids))
        done, answer = anyio.Event(), list[dict[str, Any]]()
        self._waiting[request_id] = (done, answer)
        try:
            await self._process.stdin.send(f"{request_id} {method} {path}\n".encode())
            with anyio.fail_after(self.timeout + 5):  # the child's own timeout comes first
                await done.wait()
        finally:
            del self._waiting[request_id]
        (reply,) = answer
        if "error" in reply:
            error = TimeoutError if reply["kind"] == "timeout" else ConnectionError
            raise error(f"{method} {path}: {reply['error']}")
        body = reply["body"].encode("latin-1")
        return RawReply(reply["status"], body, reply["sent_wall"], reply["rtt"])

    async def _read_answers(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        lines = BufferedByteReceiveStream(self._process.stdout)
        while True:
            try:
                line = await lines.receive_until(b"\n", 1 << 24)
            except (anyio.EndOfStream, anyio.IncompleteRead):
                return
            reply = json.loads(line)
            waiting = self._waiting.get(reply["id"])
            if waiting is not None:  # else its caller was cancelled
                waiting[1].append(reply)
                waiting[0].set()
