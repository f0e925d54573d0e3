"""Soak: normal traffic mixed with every abuse of issue 13, against a real `kvscope
serve` process with two API keys, on a KV pool small enough to force preemption.

Normal traffic: SSE streams read to the end or dropped part-way, detached jobs
cancelled by `DELETE`, OpenAI calls with `n` samples (streamed and not), WebSocket
sessions. Abuse: parent chains as deep as allowed, cancelled by `DELETE` or by their
root's timeout; lone surrogates on every route; requests without a key holding a 1 MiB
`Content-Length` open; oversized bodies; prompts big enough to be tokenized off the
loop or refused before tokenizing; the most stop strings allowed; floods of `n=16`.

Throughout: no 5xx; and, where the machine is not already oversubscribed by other
work, the server's event-loop lag p99 and the p99 of `/health` (probed by its own
process on its own connection) under 50 ms (elsewhere they measure the scheduler more
than the server; the figures are reported either way). After: 0 blocks in use, 0 live requests, 0 request
tasks, one audit line per request, and a clean exit on SIGTERM. Marked `soak`; runs
on both backends, SOAK_SECONDS each (KVSCOPE_SOAK_SECONDS overrides).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import websockets
import websockets.exceptions

from tests.conftest import REPORT_LINES

from .conftest import BACKENDS

pytestmark = pytest.mark.soak

ROOT = Path(__file__).resolve().parents[2]
SOAK_SECONDS = float(os.environ.get("KVSCOPE_SOAK_SECONDS", "20"))
BASELINE_SECONDS = 2.0
KEYS = ("alpha-key", "beta-key")
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
LONE = "a\\ud800b"  # a lone surrogate, escaped in JSON text
#: Seconds each client waits between two rounds: a steady mix, not a benchmark (the
#: clients share the machine's cores with the server).
PACE = 0.1


class Soak:
    """What the clients saw: every status, every request id, the health latencies."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.deadline = time.monotonic() + SOAK_SECONDS
        self.statuses: Counter[int] = Counter()
        self.server_errors: list[str] = []
        self.ids: set[str] = set()
        self.health_ms: list[float] = []
        self.rng = random.Random(13)

    @property
    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def saw(self, response: httpx.Response, what: str) -> httpx.Response:
        self.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.server_errors.append(f"{what}: {response.status_code} {response.text[:200]}")
        return response

    def client(self, key: str | None = KEYS[0]) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=60)


# -- normal traffic ---------------------------------------------------------------------


async def sse_streams(soak: Soak, key: str) -> None:
    async with soak.client(key) as client:
        while soak.running:
            body = {
                "prompt": "stream " * soak.rng.randint(1, 40),
                "max_tokens": soak.rng.randint(4, 60),
                "ignore_eos": True,
                "stream": True,
            }
            drop_after = soak.rng.choice([None, 1, 5])
            await anyio.sleep(PACE)
            async with client.stream("POST", "/generate", json=body) as response:
                soak.saw(response, "SSE")
                if response.status_code != 200:
                    continue
                soak.ids.add(response.headers["x-request-id"])
                tokens = 0
                async for line in response.aiter_lines():
                    tokens += line.startswith("data: ")
                    if drop_after is not None and tokens >= drop_after:
                        break  # a disconnect cancels the request


async def jobs_and_deletes(soak: Soak, key: str) -> None:
    async with soak.client(key) as client:
        while soak.running:
            body = {"prompt": "job " * soak.rng.randint(1, 60), **LONG}
            body["max_tokens"] = soak.rng.randint(2, 80)
            response = soak.saw(await client.post("/generate", json=body), "job")
            if response.status_code != 202:
                await anyio.sleep(0.05)
                continue
            request_id = response.json()["id"]
            soak.ids.add(request_id)
            await anyio.sleep(PACE + soak.rng.random() * 0.2)
            soak.saw(await client.delete(f"/requests/{request_id}"), "DELETE")
            soak.saw(await client.get(f"/requests/{request_id}"), "GET")


async def openai_samples(soak: Soak, key: str) -> None:
    async with soak.client(key) as client:
        while soak.running:
            body = {
                "prompt": "openai " * soak.rng.randint(1, 30),
                "max_tokens": soak.rng.randint(2, 30),
                "n": soak.rng.randint(1, 4),
                "stream": soak.rng.random() < 0.5,
            }
            await anyio.sleep(PACE)
            if body["stream"]:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    soak.saw(response, "OpenAI SSE")
                    if response.status_code == 200:
                        soak.ids.add(response.headers["x-request-id"])
                        async for _ in response.aiter_lines():
                            pass
            else:
                response = soak.saw(await client.post("/v1/completions", json=body), "OpenAI")
                if response.status_code == 200:
                    soak.ids.add(response.json()["id"])


def _late_cancel(event: dict[str, Any]) -> bool:
    """The answer to a cancel that reached the socket after its generation's `done`
    (the generation won the race): a conflict, sent after that `done`."""
    return event["type"] == "error" and event["error"]["type"] == "conflict_error"


async def websocket_sessions(soak: Soak, key: str) -> None:
    url = soak.url.replace("http://", "ws://") + "/ws/generate"
    headers = {"Authorization": f"Bearer {key}"}
    while soak.running:
        async with websockets.connect(url, additional_headers=headers) as ws:
            for _ in range(3):
                await ws.send(json.dumps({"prompt": "ws", **LONG, "max_tokens": 40}))
                cancel = soak.rng.random() < 0.5
                while True:
                    event = json.loads(await ws.recv())
                    if _late_cancel(event):
                        continue
                    if event["type"] == "start":
                        soak.ids.add(event["id"])
                        if cancel:
                            await ws.send(json.dumps({"type": "cancel"}))
                    if event["type"] in ("done", "error"):
                        break
            await ws.send(f'{{"prompt": "{LONE}"}}')  # invalid Unicode: an error event
            event = json.loads(await ws.recv())
            while _late_cancel(event):
                event = json.loads(await ws.recv())
            assert event["type"] == "error" and event["error"]["type"] == "invalid_request_error"
            if soak.rng.random() < 0.5:
                await ws.send(json.dumps({"prompt": "dropped", **LONG}))
                # leaving the block drops the socket mid-generation: a disconnect cancels


# -- abuse ---------------------------------------------------------------------------


async def deep_chains(soak: Soak, key: str, depth: int) -> None:
    async with soak.client(key) as client:
        while soak.running:
            by_timeout = soak.rng.random() < 0.5
            root = {"prompt": "root", **LONG, **({"timeout": 1.0} if by_timeout else {})}
            response = soak.saw(await client.post("/generate", json=root), "chain root")
            if response.status_code != 202:
                await anyio.sleep(0.1)
                continue
            chain = [response.json()["id"]]
            soak.ids.add(chain[0])
            for _ in range(depth):
                body = {"prompt": "link", "parent": chain[-1], **LONG}
                response = soak.saw(await client.post("/generate", json=body), "chain")
                if response.status_code != 202:
                    break  # 409 once the root timed out; 429 when the queue is full
                chain.append(response.json()["id"])
                soak.ids.add(chain[-1])
                await anyio.sleep(PACE / 5)
            else:
                body = {"prompt": "too deep", "parent": chain[-1], **LONG}
                refused = soak.saw(await client.post("/generate", json=body), "too deep")
                assert refused.status_code in (400, 409), refused.text
            if not by_timeout:
                soak.saw(await client.delete(f"/requests/{chain[0]}"), "chain DELETE")
            else:
                await anyio.sleep(1.0)


async def bad_input(soak: Soak) -> None:
    bodies = [
        ("/generate", f'{{"prompt": "{LONE}"}}'),
        ("/generate", f'{{"prompt": "x", "stop": ["{LONE}"]}}'),
        ("/v1/completions", f'{{"prompt": "{LONE}"}}'),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}'),
        ("/generate", json.dumps({"prompt": "x", "stop": ["s"] * 17})),
        ("/generate", json.dumps({"prompt": "x" * 100_000})),  # refused before tokenizing
        ("/generate", json.dumps({"prompt": "y" * 30_000})),  # tokenized off the loop
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "z" * 30_000}]}),
        ),
    ]
    headers = {"content-type": "application/json"}
    async with soak.client() as client:
        while soak.running:
            for path, body in bodies:
                response = await client.post(path, content=body.encode(), headers=headers)
                assert soak.saw(response, path).status_code == 400, response.text
                await anyio.sleep(PACE)
            stops = {"stop": ["q" * 256] * 16, "max_tokens": 20, "ignore_eos": True}
            response = soak.saw(
                await client.post("/generate", json={"prompt": "s", **stops}), "stops"
            )
            if response.status_code == 202:
                soak.ids.add(response.json()["id"])
            await anyio.sleep(PACE * 4)


async def unauthenticated(soak: Soak) -> None:
    host, port = soak.url.removeprefix("http://").split(":")
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1048576\r\n\r\n"
    )
    ws_url = soak.url.replace("http://", "ws://") + "/ws/generate"
    while soak.running:
        stream = await anyio.connect_tcp(host, int(port))
        async with stream:
            await stream.send(head)  # and never the body
            answer = await stream.receive()
            assert answer.startswith(b"HTTP/1.1 401 "), answer[:100]
            soak.statuses[401] += 1
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            async with websockets.connect(ws_url):
                pass
        assert refused.value.response.status_code == 401
        stream = await anyio.connect_tcp(host, int(port))
        async with stream:  # a key, but a body past the cap: refused from the head
            keyed = head.replace(
                b"\r\n\r\n", f"\r\nAuthorization: Bearer {KEYS[0]}\r\n\r\n".encode()
            )
            await stream.send(keyed.replace(b"1048576", b"1048577"))
            answer = await stream.receive()
            assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]
            soak.statuses[413] += 1
        await anyio.sleep(PACE)


async def sample_floods(soak: Soak, key: str) -> None:
    async with soak.client(key) as client:
        while soak.running:
            body = {"prompt": "flood", "n": 16, "max_tokens": 8, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                soak.saw(response, "n=16")
                if response.status_code == 200:
                    soak.ids.add(response.headers["x-request-id"])
                    async for _ in response.aiter_lines():
                        pass
                else:
                    assert response.status_code == 429
            await anyio.sleep(PACE * 2)


# -- the probe and the run ------------------------------------------------------------


#: The server and the prober run at a higher priority when the OS allows it: on a
#: machine shared with other work, the scheduler's delays would otherwise swamp what
#: this measures (the server's responsiveness to its own clients' abuse, which run at
#: normal priority).
NICE = -10


def _raise_priority() -> None:
    try:
        os.nice(NICE)
    except OSError:
        pass


#: The /health prober, run as its own process so that the test's clients do not
#: delay it: GET /health every 10 ms on one keep-alive connection until stdin closes,
#: then print each (wall time, round trip in ms) as a JSON list.
PROBE = """
import json, os, socket, sys, threading, time
try:
    os.nice(-10)  # as the server: see NICE
except OSError:
    pass
host, port = sys.argv[1], int(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
samples = []

def connect():
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, sock.makefile("rb")

sock, reader = connect()
while not stop.is_set():
    started = time.perf_counter()
    try:
        sock.sendall(b"GET /health HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
        status = reader.readline()
        if not status:
            raise ConnectionError("closed")
    except (ConnectionError, OSError):  # hypercorn closes a connection after 1000 requests
        sock.close()
        sock, reader = connect()
        continue
    length = 0
    while (line := reader.readline()) not in (b"\\r\\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    reader.read(length)
    samples.append((time.time(), (time.perf_counter() - started) * 1000))
    stop.wait(0.01)
sock.close()
print(json.dumps(samples))
"""


async def drive(soak: Soak, depth: int) -> None:
    alpha, beta = KEYS
    async with anyio.create_task_group() as tg:
        for key in (alpha, beta):
            tg.start_soon(sse_streams, soak, key)
            tg.start_soon(jobs_and_deletes, soak, key)
        tg.start_soon(openai_samples, soak, alpha)
        tg.start_soon(websocket_sessions, soak, beta)
        tg.start_soon(deep_chains, soak, alpha, depth)
        tg.start_soon(deep_chains, soak, beta, depth)
        tg.start_soon(bad_input, soak)
        tg.start_soon(unauthenticated, soak)
        tg.start_soon(sample_floods, soak, beta)


def loop_lag_p99(url: str) -> float:
    """The server's own event-loop lag p99 in seconds (the upper bound of its bucket),
    from the histogram it exports on /metrics."""
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    pattern = r'kvscope_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)'
    buckets = [(float(le), float(count)) for le, count in re.findall(pattern, text)]
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= 0.99 * total)


def stats(url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    return httpx.get(url + "/stats", headers=headers, timeout=30).json()


@pytest.mark.parametrize("backend", BACKENDS)
def test_soak(backend: str, tmp_path: Path) -> None:
    from kvscope import EngineConfig

    depth = EngineConfig().max_request_depth
    load_before = os.getloadavg()[0]  # other work on the machine, before ours starts
    audit = tmp_path / "audit.jsonl"
    keys = tmp_path / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    command = [
        sys.executable, "-m", "kvscope.cli", "serve", "--model", "tiny-random",
        "--device", "cpu", "--port", "0", "--backend", backend, "--audit-log", str(audit),
        "--api-key-file", str(keys), "--num-kv-blocks", "96", "--max-num-seqs", "16",
        "--max-queued-requests", "128", "--model-threads", "1", "--debug",
    ]  # fmt: skip
    log = tmp_path / "server.log"  # a file, not a pipe: a full pipe would stall the server
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=_raise_priority,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, line
        soak = Soak(match.group(0))
        host, port = soak.url.removeprefix("http://").split(":")
        prober = subprocess.Popen(
            [sys.executable, "-c", PROBE, host, port],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(BASELINE_SECONDS)  # the idle server first: the machine's own noise
            soak.deadline = time.monotonic() + SOAK_SECONDS
            soak_started = time.time()
            anyio.run(drive, soak, depth)
        finally:
            probed, _ = prober.communicate("", timeout=60)  # closing stdin stops it
        samples = json.loads(probed)
        idle_ms = [ms for at, ms in samples if at < soak_started]
        soak.health_ms = [ms for at, ms in samples if at >= soak_started]
        lag_p99 = loop_lag_p99(soak.url)
        deadline = time.monotonic() + 60
        while (now := stats(soak.url))["live_requests"] or now["kv_blocks_in_use"] or now["tasks"]:
            assert time.monotonic() < deadline, now
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr = log.read_text()
        print("the server's log ends:\n", stderr[-5000:])  # shown if the test fails
    assert process.returncode == 0, stderr[-3000:]
    assert not soak.server_errors, soak.server_errors[:5]
    assert "Traceback" not in stderr, stderr[-3000:]
    ids = [json.loads(line)["id"] for line in audit.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == now["finished"] + now["cancelled"] + now["failed"]
    assert soak.ids <= set(ids)
    samples, idle = sorted(soak.health_ms), sorted(idle_ms)
    p99, idle_p99 = samples[int(len(samples) * 0.99)], idle[int(len(idle) * 0.99)]
    REPORT_LINES.append(
        f"soak [{backend}] {SOAK_SECONDS:.0f} s: {len(ids)} requests ({now['cancelled']} "
        f"cancelled), statuses {dict(sorted(soak.statuses.items()))}; /health over "
        f"{len(samples)} probes p50 {statistics.median(samples):.1f} ms, p99 {p99:.1f} ms, "
        f"max {samples[-1]:.1f} ms (idle server first: p99 {idle_p99:.1f} ms); server "
        f"loop lag p99 <= {lag_p99 * 1000:.0f} ms; load average before {load_before:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    # Latency is held to 50 ms where the machine is not already oversubscribed by other
    # work: there, both the server's loop lag and the probe's round trip measure the
    # scheduler's queue more than the server (seen on a 2-CPU machine at load 8: an
    # idle server's /health p99 of 12-70 ms). The figures are reported either way.
    if load_before < (os.cpu_count() or 1):
        assert lag_p99 <= 0.05, REPORT_LINES[-1]
        assert p99 < 50, REPORT_LINES[-1]
