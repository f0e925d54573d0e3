"""A served level of `bench throughput`: a workload at a concurrency over HTTP.

`stream_completion` sends one streaming `POST /v1/completions` with the prompt as
token ids (kvscope serve and vLLM alike) and records when each SSE chunk arrives;
`run_http_level` runs a workload at a concurrency on the light client of `core.http`
and reports the same figures as the in-process engine runs, plus the client's CPU.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import anyio
import attrs

from ..core.http import CpuClock, session
from ..core.workload import Workload
from .levels import Timing, level_figures
from .records import Level


async def stream_completion(
    session: aiohttp.ClientSession,
    model: str,
    prompt: list[int],
    max_tokens: int,
    sampling: dict[str, Any],
) -> Timing:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        **sampling,
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
    return Timing(t0, times, usage if usage is not None else len(times))


async def run_http_level(
    base_url: str, model: str, workload: Workload, concurrency: int, timeout: float
) -> Level:
    """The workload at `concurrency`, with the client's own CPU seconds and their share
    of the machine over the level."""
    limit = anyio.Semaphore(concurrency)
    records: list[Timing] = []

    async def one(client: aiohttp.ClientSession, prompt: list[int]) -> None:
        async with limit:
            records.append(
                await stream_completion(
                    client, model, prompt, workload.max_tokens, workload.sampling
                )
            )

    clock = CpuClock()
    async with session(base_url, timeout=timeout, connections=concurrency + 4) as client:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                for prompt in workload.prompts:
                    tg.start_soon(one, client, prompt)
    level = level_figures(concurrency, records, clock.wall)
    return attrs.evolve(
        level, client_cpu_s=round(clock.cpu, 3), client_cpu_share=round(clock.share(), 4)
    )
