"""Driving one `kvscope serve` through `bench cancel`'s runs.

`bench_server` starts the server, warms it up, then runs `--rounds` pairs (with
cancels, baseline; alternating which goes first) and pools each kind's samples. Each
run opens every stream at once on one `aiohttp` session, polls `GET /stats` beside
them (and samples the core the server's event loop runs on), scrapes `/metrics` before
and after (for the loop-lag histogram of the run alone) and times the client's own CPU.
`settle` reads `/stats` once nothing is live.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import aiohttp
import anyio

from ...web.settings import LAG_INTERVAL
from ..core import prometheus
from ..core.http import CpuClock, RawHttp, session
from ..core.servers import Server, last_core
from ..core.wake_floor import WakeFloor
from ..core.workload import Deadline
from .client import Plan, poll_stats, run_stream
from .plans import make_plans
from .records import RawRun, StreamRecord

LAG = "kvscope_event_loop_lag_seconds"
GAP = "kvscope_checkpoint_gap_seconds"


async def _histograms(client: aiohttp.ClientSession) -> tuple[dict[float, float], ...]:
    """The loop-lag and checkpoint-gap histograms, as `/metrics` has them now."""
    async with client.get("/metrics") as response:
        text = await response.text()
    return prometheus.histogram(text, LAG), prometheus.histogram(text, GAP)


async def sample_loop_core(
    pid: int | None, interval: float, stop: anyio.Event, counts: dict[int, int]
) -> None:
    """Count, every `interval` s until `stop` is set, the core the server's event loop
    (its process's main thread) last ran on. Where the real-time loop settles when the
    server starts decides the kind of run on a machine whose cores the benchmark's own
    clients share (docs/benchmarks/README.md, "Measured settings": the loop's core sampled by
    `bench cancel`)."""
    while pid is not None and not stop.is_set():
        if (core := last_core(pid)) is not None:
            counts[core] = counts.get(core, 0) + 1
        with anyio.move_on_after(interval):
            await stop.wait()


async def one_run(
    base_url: str, plans: list[Plan], args: argparse.Namespace, loop_pid: int | None = None
) -> RawRun:
    records: list[StreamRecord] = []
    timeline: list[dict[str, Any]] = []
    loop_cores: dict[int, int] = {}
    stop = anyio.Event()
    connections = 2 * len(plans) + 8  # a stream and a DELETE each, the poller, spare
    async with (
        RawHttp(base_url) as control,
        session(base_url, timeout=args.run_timeout, connections=connections) as client,
    ):
        before = await _histograms(client)
        clock = CpuClock()
        origin = clock.wall0

        async def one(plan: Plan) -> None:
            records.append(await run_stream(client, control, plan, args.max_tokens, origin))

        with anyio.fail_after(args.run_timeout):
            async with WakeFloor(LAG_INTERVAL) as floor, anyio.create_task_group() as tg:
                tg.start_soon(poll_stats, client, args.stats_interval, origin, stop, timeline)
                tg.start_soon(sample_loop_core, loop_pid, args.stats_interval, stop, loop_cores)
                async with anyio.create_task_group() as streams:
                    for plan in plans:
                        streams.start_soon(one, plan)
                wall, cpu = clock.wall, clock.cpu
                stop.set()
        lag, gap = map(prometheus.window, before, await _histograms(client))
    return RawRun(
        wall_s=round(wall, 3),
        records=sorted(records, key=lambda r: r.index),
        timeline=timeline,
        loop_lag_buckets=lag,
        checkpoint_gap_buckets=gap,
        client_cpu_s=cpu,
        wake_floor=floor.samples,
        loop_cores=loop_cores,
    )


async def settle(base_url: str, timeout: float = 30) -> dict[str, Any]:
    """`GET /stats` once no request is live (or after `timeout` s), plus `/health`."""
    deadline = Deadline(timeout)
    async with session(base_url, timeout=10) as client:
        while True:
            async with client.get("/stats") as response:
                stats = await response.json()
            if stats.get("live_requests", 0) == 0 or deadline.passed:
                break
            await anyio.sleep(0.1)
        async with client.get("/health") as response:
            text = await response.text()
    try:
        health: Any = json.loads(text)
    except ValueError:
        health = text[:200]
    return {"stats": stats, "health": health}


async def warm_up(server: Server, args: argparse.Namespace, vocab: int) -> None:
    """Up to 8 requests of the real shape (8 tokens each), so that neither measured run
    pays first-use costs."""
    warm = make_plans(args, vocab, 99, False)[:8]
    async with (
        RawHttp(server.base_url) as control,
        session(server.base_url, timeout=args.run_timeout) as client,
        anyio.create_task_group() as tg,
    ):
        for plan in warm:
            tg.start_soon(run_stream, client, control, plan, 8, time.perf_counter())


async def bench_server(
    server: Server, args: argparse.Namespace, vocab: int
) -> tuple[RawRun, RawRun, dict[str, Any]]:
    """(with cancels, baseline, after) of one server, the rounds pooled."""
    runs: dict[str, list[RawRun]] = {"with_cancels": [], "baseline": []}
    async with server:
        await server.settled()
        await warm_up(server, args, vocab)
        for i in range(args.rounds):
            order = ("with_cancels", "baseline") if i % 2 == 0 else ("baseline", "with_cancels")
            for name in order:
                print(f"  round {i + 1}/{args.rounds}: {name.replace('_', ' ')} ...", flush=True)
                seed = args.seed + 1 + 2 * i + (name == "baseline")  # fresh prompts every run
                plans = make_plans(args, vocab, seed, name != "baseline")
                pid = server.process.pid if server.process is not None else None
                runs[name].append(await one_run(server.base_url, plans, args, pid))
        after = await settle(server.base_url)
    after["processes_left"] = len(server.left_behind)  # counted once it has stopped
    return merge(runs["with_cancels"]), merge(runs["baseline"]), after


def merge(parts: list[RawRun]) -> RawRun:
    """Pool the records and the histograms of several runs, each record marked with
    its run's place in `parts`; keep the first timeline."""
    lag: dict[float, float] = {}
    gap: dict[float, float] = {}
    cores: dict[int, int] = {}
    for i, part in enumerate(parts):
        for record in part.records:
            record.round = i
        for core, samples in part.loop_cores.items():
            cores[core] = cores.get(core, 0) + samples
        for le, n in part.loop_lag_buckets.items():
            lag[le] = lag.get(le, 0.0) + n
        for le, n in part.checkpoint_gap_buckets.items():
            gap[le] = gap.get(le, 0.0) + n
    return RawRun(
        wall_s=round(sum(p.wall_s for p in parts), 3),
        records=[r for p in parts for r in p.records],
        timeline=parts[0].timeline,
        loop_lag_buckets=lag,
        checkpoint_gap_buckets=gap,
        client_cpu_s=sum(p.client_cpu_s for p in parts),
        wake_floor=[x for p in parts for x in p.wake_floor],
        loop_cores=cores,
        rounds=len(parts),
    )
