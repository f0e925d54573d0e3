"""One concurrency level's figures from per-request timings (engine or HTTP runs)."""

from __future__ import annotations

import attrs

from ..core.stats import summary
from .records import Level


@attrs.frozen
class Timing:
    """One request: when it was sent, when each token arrived (perf_counter), tokens."""

    start: float
    token_times: list[float]
    tokens: int


def level_figures(concurrency: int, records: list[Timing], wall: float) -> Level:
    ttft = [r.token_times[0] - r.start for r in records if r.token_times]
    itl = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    tokens = sum(r.tokens for r in records)
    return Level(
        concurrency=concurrency,
        requests=len(records),
        output_tokens=tokens,
        wall_s=round(wall, 3),
        tokens_per_s=round(tokens / wall, 1),
        ttft_ms=summary(ttft, 1e3),
        itl_ms=summary(itl, 1e3),
    )
