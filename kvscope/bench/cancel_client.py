"""The client side of `bench cancel`: one streaming request each, cancelled or not.

`Plan` says what the client does with request `index`: keep reading to the end
(`keep`), cancel it with `DELETE /requests/{id}` once `after_tokens` tokens arrived
plus a random jitter (`delete`), or close the stream then instead (`disconnect`).
`run_stream` carries a plan out against `POST /generate` with `"stream": true` and
records every token's arrival, the DELETE round trip and its CancelReport, or the
moment the stream was closed. `poll_stats` samples `GET /stats` until told to stop.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import attrs
import httpx


@attrs.frozen
class Plan:
    index: int
    prompt: list[int]
    action: str  # keep | delete | disconnect
    after_tokens: int = 0
    jitter_s: float = 0.0


async def run_stream(
    client: httpx.AsyncClient, plan: Plan, max_tokens: int, origin: float
) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "index": plan.index,
        "action": plan.action,
        "start": time.perf_counter(),
        "token_times": [],
        "tokens": 0,
    }
    body = {
        "prompt_token_ids": plan.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    acted = False
    async with client.stream("POST", "/generate", json=body) as response:
        rec["http_status"] = response.status_code
        if response.status_code != 200:
            rec["error"] = (await response.aread())[:300].decode(errors="replace")
            return rec
        rec["id"] = response.headers.get("x-request-id")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            rec["id"] = rec["id"] or event.get("id")
            if event.get("type") == "done":
                rec["done"] = {
                    k: event.get(k)
                    for k in ("status", "finish_reason", "cancel_reason", "completion_tokens")
                }
                break
            if event.get("type") != "token" or acted:
                continue
            rec["token_times"].append(time.perf_counter())
            rec["tokens"] += len(event.get("token_ids") or [])
            if plan.action == "keep" or rec["tokens"] < plan.after_tokens:
                continue
            acted = True
            await anyio.sleep(plan.jitter_s)
            rec["cancel_at"] = time.perf_counter() - origin
            if plan.action == "disconnect":
                rec["closed_wall"] = time.time()
                break  # leaving `client.stream` closes the connection
            sent = time.perf_counter()
            reply = await client.delete(f"/requests/{rec['id']}")
            rec["delete_rtt"] = time.perf_counter() - sent
            rec["delete_status"] = reply.status_code
            try:
                rec["report"] = reply.json()
            except ValueError:
                rec["report"] = None
    return rec


async def poll_stats(
    client: httpx.AsyncClient,
    interval: float,
    origin: float,
    stop: anyio.Event,
    out: list[dict[str, Any]],
    limit_s: float,
) -> None:
    """Sample `GET /stats` every `interval` s until `stop` is set or `limit_s` pass."""
    with anyio.move_on_after(limit_s):
        while not stop.is_set():
            try:
                stats = (await client.get("/stats")).json()
                out.append({"t": round(time.perf_counter() - origin, 4), **stats})
            except (httpx.HTTPError, ValueError):
                pass
            with anyio.move_on_after(interval):
                await stop.wait()
