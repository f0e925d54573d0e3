"""The HTTP client the benchmarks drive servers with (kvscope serve and vLLM alike).

It shares the 2 cores with the server it measures, so it is light: `aiohttp` (not
httpx, which was heavy enough to halve a peer's figure), one JSON parse per SSE event,
and its own CPU seconds reported with every level. `stream_completion` sends one
streaming `POST /v1/completions` with the prompt as token ids and records when each
SSE chunk arrives; `run_http_level` runs a workload at a concurrency and reports the
same figures as the in-process engine runs. Only ever pointed at 127.0.0.1. aiohttp
runs on asyncio only: the benchmarks drive it with `anyio.run`'s default backend.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio

from .engine_run import level_figures
from .workload import Deadline, Workload


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


async def stream_completion(
    session: aiohttp.ClientSession, model: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async with session.post("/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(
                f"/v1/completions answered {response.status}: {(await response.read())[:300]!r}"
            )
        async for raw in response.content:  # one SSE line at a time
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            choice = (event.get("choices") or [None])[0]
            # A token's chunk; not a closing chunk that only carries the finish reason.
            if choice is not None and (choice.get("text") or choice.get("finish_reason") is None):
                times.append(time.perf_counter())
    return {"start": t0, "token_times": times, "tokens": usage if usage is not None else len(times)}


async def run_http_level(
    base_url: str, model: str, workload: Workload, concurrency: int, timeout: float
) -> dict[str, Any]:
    """The workload at `concurrency`; with the client's own CPU seconds (this process
    runs nothing else meanwhile) and their share of the machine over the level."""
    check_local(base_url)
    limit = anyio.Semaphore(concurrency)
    records: list[dict[str, Any]] = []

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        async with limit:
            records.append(await stream_completion(session, model, prompt, workload.max_tokens))

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    t0, cpu0 = time.perf_counter(), time.process_time()
    async with aiohttp.ClientSession(
        base_url, connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as session:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                for prompt in workload.prompts:
                    tg.start_soon(one, session, prompt)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    figures = level_figures(concurrency, records, wall)
    figures["client_cpu_s"] = round(cpu, 3)
    figures["client_cpu_share"] = round(cpu / (wall * (os.cpu_count() or 1)), 4)
    return figures
