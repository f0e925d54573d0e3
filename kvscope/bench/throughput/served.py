"""A served system's phase of `bench throughput`: start it, time its cold start, run
every level over HTTP, stop it.

The same for `kvscope serve`, vLLM and llama.cpp's `llama-server` (`Server` starts
each), so they are warmed up and measured alike: once the server answers, one request
with a prompt no level uses (its TTFT, added to the time to answering, is the time to a
first token), then the server's own settling (`Server.settled`), then each level; a
server that speculates has its speculative decoding counters read after them.
"""

from __future__ import annotations

from ..core import machine
from ..core.servers import Server
from ..core.workload import Workload
from .http_level import run_http_level
from .records import ColdStart, LoadAround, ServedRun

#: The counters read after the levels of a server that speculates (kvscope serve and
#: vLLM write them under these names).
SPEC_DECODE_PREFIX = "vllm:spec_decode_num_"


async def run_served(
    server: Server,
    model: str | None,
    levels: list[tuple[int, Workload]],
    timeout: float,
    label: str,
    threads: int,
    *,
    speculative: bool | None = None,
) -> ServedRun:
    """Start `server`, time its cold start to a first token, then run every level;
    `model` is the name the requests send (None: the one `GET /v1/models` lists);
    `speculative`: whether it runs with the run's speculative config (recorded, and
    then its spec_decode counters are read after the levels)."""
    from ..core.http import served_model

    out = []
    before = machine.load_average()
    async with server:
        model = model or await served_model(server.base_url)
        warm = Workload([levels[0][1].prompts[0][::-1]], 4)  # a prompt none of the levels uses
        first = await run_http_level(server.base_url, model, warm, 1, timeout)
        assert server.spawned_at is not None and server.ready_at is not None
        ready = server.ready_at - server.spawned_at
        # The first request is sent once the server is ready: its TTFT is added.
        first_token = ready + (first.ttft_ms.p50 or 0) / 1e3
        fully_up = await server.settled()
        cold = ColdStart(
            ready_s=round(ready, 2),
            first_token_s=round(first_token, 2),
            fully_up_s=None if fully_up is None else round(fully_up, 2),
        )
        print(f"  {label} threads={threads} cold start: {cold}", flush=True)
        for c, workload in levels:
            level = await run_http_level(server.base_url, model, workload, c, timeout)
            out.append(level)
            print(
                f"  {label} threads={threads} concurrency={c}: {level.tokens_per_s:.0f} tok/s, "
                f"ITL p50 {level.itl_ms.p50} ms, client CPU {level.client_cpu_s} s",
                flush=True,
            )
        counts = await spec_decode_counts(server.base_url) if speculative else None
    return ServedRun(
        threads=threads,
        levels=out,
        cold_start=cold,
        settings=server.settings,
        load_average=LoadAround(before=before, after=machine.load_average()),
        processes_left=len(server.left_behind),  # counted once it has stopped
        speculative=speculative,
        spec_decode=counts,
    )


async def spec_decode_counts(base_url: str) -> dict[str, int] | None:
    """The server's `vllm:spec_decode_num_*` counters (by position excluded), or None
    where its `/metrics` has none."""
    import aiohttp

    from ..core import prometheus

    async with (
        aiohttp.ClientSession(base_url, timeout=aiohttp.ClientTimeout(total=30)) as client,
        client.get("/metrics") as response,
    ):
        text = await response.text() if response.status == 200 else ""
    totals = prometheus.counter_totals(text, SPEC_DECODE_PREFIX)
    counts = {k: round(v) for k, v in totals.items() if not k.endswith("_per_pos")}
    return counts or None
