"""The periodic stats line in the server's log, as vLLM writes one (`--disable-log-stats`
turns it off).

Every `interval` seconds while there is work: prompt and generation throughput over
the interval, requests running and waiting, requests ended (and how many of them were
cancelled), the KV cache in use and the prefix cache's hit rate over the interval, and,
where drafts were verified, speculative decoding's acceptance over it. An idle server
writes one line when it becomes idle, then none until work comes.
"""

from __future__ import annotations

import logging
import time

import anyio
import attrs

from kvscope import Engine

log = logging.getLogger("kvscope.stats")


@attrs.frozen
class Totals:
    """The engine's running counts at one moment."""

    at: float
    prompt_tokens: int
    cached_tokens: int
    generated: int
    ended: int
    cancelled: int
    drafted: int = 0
    accepted: int = 0

    @classmethod
    def of(cls, engine: Engine, stats: dict[str, int]) -> Totals:
        return cls(
            time.perf_counter(),
            stats["prompt_tokens_admitted"],
            stats["prompt_tokens_reused"],
            engine.step_statistics().tokens_generated,
            stats["finished"] + stats["cancelled"] + stats["failed"],
            stats["cancelled"],
            stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"],
        )


def stats_line(before: Totals, now: Totals, stats: dict[str, int]) -> str:
    seconds = max(now.at - before.at, 1e-9)
    queried = now.prompt_tokens - before.prompt_tokens
    hits = now.cached_tokens - before.cached_tokens
    hit_rate = f"{100 * hits / queried:.1f}%" if queried else "-"
    in_use = 100 * stats["kv_blocks_in_use"] / max(1, stats["kv_blocks_total"])
    drafted, accepted = now.drafted - before.drafted, now.accepted - before.accepted
    speculation = (
        f", draft acceptance {100 * accepted / drafted:.1f}% ({accepted} of {drafted} tokens)"
        if drafted
        else ""
    )
    return (
        f"prompt throughput {queried / seconds:.1f} tokens/s, "
        f"generation throughput {(now.generated - before.generated) / seconds:.1f} tokens/s, "
        f"running {stats['running']}, waiting {stats['waiting']}, "
        f"ended {now.ended - before.ended} ({now.cancelled - before.cancelled} cancelled), "
        f"KV cache {in_use:.1f}% in use, prefix cache hit rate {hit_rate}{speculation}"
    )


async def log_stats(engine: Engine, interval: float) -> None:
    """Forever: every `interval` seconds, the stats line, while there is work."""
    stats = engine.stats()
    before, quiet = Totals.of(engine, stats), True
    while True:
        await anyio.sleep(interval)
        stats = engine.stats()
        now = Totals.of(engine, stats)
        busy = now != attrs.evolve(before, at=now.at) or stats["running"] or stats["waiting"]
        if busy or not quiet:
            log.info("%s", stats_line(before, now, stats))
        before, quiet = now, not busy
