"""The HTTP client the benchmarks drive servers with (kvscope serve and vLLM alike).

`stream_completion` sends one streaming `POST /v1/completions` with the prompt as token
ids and records when each SSE chunk arrives; `run_http_level` runs a workload at a
concurrency and reports the same figures as the in-process engine runs. Only ever
pointed at 127.0.0.1.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import httpx

from .engine_run import level_figures
from .workload import Deadline, Workload


def check_local(base_url: str) -> None:
    host = httpx.URL(base_url).host
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"benchmarks only send traffic to 127.0.0.1, not {host}")


async def served_model(base_url: str) -> str:
    """The model id the server at `base_url` answers to (its `GET /v1/models`): an
    OpenAI-compatible server refuses any other name."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def wait_ready(base_url: str, path: str, timeout: float, alive=lambda: True) -> None:
    """Poll `path` until it answers 200, the process dies, or `timeout` s pass."""
    deadline = Deadline(timeout)
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
        while not deadline.passed:
            if not alive():
                raise RuntimeError(f"the server at {base_url} exited while starting")
            try:
                if (await client.get(path)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await anyio.sleep(0.5)
    raise TimeoutError(f"{base_url}{path} was not ready after {timeout:.0f} s")


async def stream_completion(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
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
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"/v1/completions answered {response.status_code}: {(await response.aread())[:300]!r}"
            )
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
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
    check_local(base_url)
    limit = anyio.Semaphore(concurrency)
    records: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        async with limit:
            records.append(await stream_completion(client, model, prompt, workload.max_tokens))

    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4
    )
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                for prompt in workload.prompts:
                    tg.start_soon(one, client, prompt)
    wall = time.perf_counter() - t0
    return level_figures(concurrency, records, wall)
