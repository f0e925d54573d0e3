"""The targets of `bench throughput`, derived from its levels (so also recomputed for
files written before the headline had this shape).

Per thread count and concurrency: kvscope served against vLLM served (tokens/s >= 1.0x,
TTFT p50 no worse), the engine's in-process figure beside them; and kvscope against
`transformers` one request at a time at the top concurrency (>= 3x).
"""

from __future__ import annotations

from .records import (
    EngineRun,
    Headline,
    Level,
    LevelHeadline,
    ThreadsHeadline,
    ThroughputResult,
    level_of,
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _tps(level: Level | None) -> float | None:
    return None if level is None else level.tokens_per_s


def _ttft(level: Level | None) -> float | None:
    return None if level is None else level.ttft_ms.p50


def level_headline(ours: Level | None, peer: Level | None, engine: Level | None) -> LevelHeadline:
    x_vllm = _ratio(_tps(ours), _tps(peer))
    met = ttft_ok = None
    if x_vllm is not None and ours is not None and peer is not None:
        met = x_vllm >= 1
        ours_ttft, peer_ttft = ours.ttft_ms.p50, peer.ttft_ms.p50
        ttft_ok = None if ours_ttft is None or peer_ttft is None else ours_ttft <= peer_ttft
    return LevelHeadline(
        engine_tokens_per_s=_tps(engine),
        kvscope_serve_tokens_per_s=_tps(ours),
        vllm_tokens_per_s=_tps(peer),
        kvscope_serve_ttft_p50_ms=_ttft(ours),
        vllm_ttft_p50_ms=_ttft(peer),
        x_vllm=x_vllm,
        target_vllm_met=met,
        ttft_no_worse=ttft_ok,
    )


def threads_headline(result: ThroughputResult, run: EngineRun) -> ThreadsHeadline:
    # The first served run of this thread count: that of the first `--worker` given.
    served = next((r.levels for r in result.kvscope_serve if r.threads == run.threads), [])
    vllm = next((r.levels for r in result.vllm if r.threads == run.threads), [])
    levels = {
        str(c): level_headline(level_of(served, c), level_of(vllm, c), level_of(run.levels, c))
        for c in result.config.concurrency
    }
    hf = next((h for h in result.transformers if h.threads == run.threads), None)
    top = max(result.config.concurrency)
    ours_top = level_of(served, top) or level_of(run.levels, top)
    if hf is None or ours_top is None:
        return ThreadsHeadline(levels=levels)
    one = hf.one_at_a_time.tokens_per_s
    x = _ratio(ours_top.tokens_per_s, one)
    return ThreadsHeadline(
        levels=levels,
        transformers_one_at_a_time_tokens_per_s=one,
        x_transformers_one_at_a_time=x,
        target_3x_transformers_met=(x or 0) >= 3,
    )


def headline(result: ThroughputResult) -> Headline:
    return Headline(
        concurrency=max(result.config.concurrency),
        by_threads={str(run.threads): threads_headline(result, run) for run in result.kvscope},
    )
