"""The client side of `bench cancel`: one streaming request each, cancelled or not.

`Plan` says what the client does with request `index`: keep reading to the end
(`keep`), cancel it with `DELETE /requests/{id}` once `after_tokens` tokens arrived
plus a random jitter (`delete`), or close the stream then instead (`disconnect`).
`run_stream` carries a plan out against `POST /generate` with `"stream": true` on the
light `aiohttp` client (the DELETE on `RawHttp`, whose own time, and the time its
answer would wait for the streams' event loop, is not part of the round trip it
measures), recording every token's arrival, the DELETE's send and answer
(client clock and wall clock, to line up with the audit log) and its CancelReport, or
the moment the stream was closed. `poll_stats` samples `GET /stats` until told to stop.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import anyio
import attrs

from ..core.http import RawHttp
from .records import StreamRecord


@attrs.frozen
class Plan:
    index: int
    prompt: list[int]
    action: str  # keep | delete | disconnect
    after_tokens: int = 0
    jitter_s: float = 0.0


async def run_stream(
    session: aiohttp.ClientSession, control: RawHttp, plan: Plan, max_tokens: int, origin: float
) -> StreamRecord:
    rec = StreamRecord(index=plan.index, action=plan.action, start=time.perf_counter())
    body = {
        "prompt_token_ids": plan.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with session.post("/generate", json=body) as response:
        rec.http_status = response.status
        if response.status != 200:
            rec.error = (await response.read())[:300].decode(errors="replace")
            return rec
        rec.id = response.headers.get("x-request-id")
        async for line in response.content:  # one SSE line at a time
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            rec.id = rec.id or event.get("id")
            if event.get("type") == "done":
                keys = ("status", "finish_reason", "cancel_reason", "completion_tokens")
                rec.done = {k: event.get(k) for k in keys}
                break
            if event.get("type") != "token" or rec.cancel_at is not None:
                continue  # after a DELETE: read on, unmeasured, to the end event
            rec.token_times.append(time.perf_counter())
            rec.tokens += len(event.get("token_ids") or [])
            if plan.action != "keep" and rec.tokens >= plan.after_tokens:
                await anyio.sleep(plan.jitter_s)
                rec.cancel_at = time.perf_counter() - origin
                if plan.action == "disconnect":
                    rec.closed_wall = time.time()
                    response.close()  # drops the connection: the server sees a disconnect
                    break
                await delete(control, rec)
    return rec


async def delete(control: RawHttp, rec: StreamRecord) -> None:
    """`DELETE /requests/{id}`, timed by `RawHttp`'s process, by its clock and by the
    wall clock."""
    reply = await control.request("DELETE", f"/requests/{rec.id}")
    rec.delete_sent_wall, rec.delete_rtt = reply.sent_wall, reply.rtt
    rec.delete_reply_wall = reply.sent_wall + reply.rtt
    rec.delete_status = reply.status
    text = reply.body
    try:
        report = json.loads(text)
    except ValueError:
        report = None
    rec.report = report if isinstance(report, dict) else None


async def poll_stats(
    session: aiohttp.ClientSession,
    interval: float,
    origin: float,
    stop: anyio.Event,
    out: list[dict[str, Any]],
) -> None:
    """Sample `GET /stats` every `interval` s until `stop` is set."""
    while not stop.is_set():
        try:
            async with session.get("/stats") as response:
                stats = await response.json()
            out.append({"t": round(time.perf_counter() - origin, 4), **stats})
        except (aiohttp.ClientError, ValueError):
            pass
        with anyio.move_on_after(interval):
            await stop.wait()
