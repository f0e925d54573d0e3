"""Served against in-process, interleaved: what the serving path costs, like with like.

The speed of this machine drifts by tens of percent over minutes (the same level, a few
minutes apart, has given 63.6 and 87.7 tok/s), so a served phase compared with the
in-process phase run minutes earlier measures the drift as much as the HTTP/SSE path.
This phase keeps both up at once, the engine in this process and `kvscope serve` in
its own, on the same worker (each idle while the other runs), and alternates them
round by round at each concurrency, each side first in every other round, the prompts
rotated each round (`rotated`) so neither side finds them in its prefix cache. The
figure is the median over the rounds of served tokens/s over in-process tokens/s, each
ratio taken from two runs next to each other.
"""

from __future__ import annotations

import statistics

import anyio
import attrs

from kvscope import Engine

from ..core.servers import Server
from ..core.workload import Workload
from .engine_run import run_level
from .http_level import run_http_level
from .records import PairedLevel, PairedRun


async def run_paired(
    server: Server,
    model: str,
    levels: list[tuple[int, Workload]],
    *,
    threads: int,
    worker: str,
    dtype: str,
    rounds: int,
    timeout: float,
    speculative_config: str | None = None,
) -> PairedRun:
    from ..core.http import served_model

    out = []
    async with (
        server,
        Engine.open(
            model,
            device="cpu",
            dtype=dtype,
            model_threads=threads,
            max_num_seqs=max(c for c, _ in levels),
            worker=worker,  # the same as the server's: the two differ by the serving path
            speculative_config=speculative_config,  # and the server's, if any
        ) as engine,
    ):
        name = await served_model(server.base_url)
        await server.settled()  # the server's model worker process is up, and the engine's:
        with anyio.fail_after(timeout):
            while worker == "process" and not engine.stats()["worker_pid"]:
                await anyio.sleep(0.1)
        warm = Workload([levels[0][1].prompts[0][::-1]], 4)
        await run_level(engine, warm, 1, timeout)
        await run_http_level(server.base_url, name, warm, 1, timeout)
        for concurrency, workload in levels:
            engine_tps, served_tps = [], []
            for round_ in range(rounds):
                prompts = rotated(workload, round_)
                sides = ["engine", "served"] if round_ % 2 == 0 else ["served", "engine"]
                for side in sides:
                    if side == "engine":
                        level = await run_level(engine, prompts, concurrency, timeout)
                        engine_tps.append(level.tokens_per_s)
                    else:
                        level = await run_http_level(
                            server.base_url, name, prompts, concurrency, timeout
                        )
                        served_tps.append(level.tokens_per_s)
            ratios = [round(s / e, 3) for s, e in zip(served_tps, engine_tps, strict=True)]
            paired = PairedLevel(
                concurrency=concurrency,
                engine_tokens_per_s=engine_tps,
                served_tokens_per_s=served_tps,
                ratios=ratios,
                ratio_median=round(statistics.median(ratios), 3),
            )
            print(
                f"  paired threads={threads} concurrency={concurrency}: served / in-process "
                f"{ratios} (median {paired.ratio_median})",
                flush=True,
            )
            out.append(paired)
    speculative = None if speculative_config is None else True
    return PairedRun(
        threads=threads, worker=worker, rounds=rounds, levels=out, speculative=speculative
    )


def rotated(workload: Workload, shift: int) -> Workload:
    """The workload's prompts rotated by `shift` tokens: the same work, but none starts
    as a prompt of an earlier round did, so the prefix cache holds none of it and every
    round prefills as the first did (given the same prompts, later rounds found them
    cached)."""
    return attrs.evolve(workload, prompts=[p[shift:] + p[:shift] for p in workload.prompts])
