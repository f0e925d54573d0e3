"""The targets of `bench throughput`, derived from its levels (so also recomputed for
files written before the headline had this shape).

Per thread count and concurrency: kvscope served against vLLM served (tokens/s >= 1.0x,
TTFT p50 no worse), the engine's in-process figure beside them; kvscope served against
llama.cpp served (tokens/s and TTFT p50, their ratio); and kvscope against
`transformers` one request at a time at the top concurrency (>= 3x). kvscope's run is
that of the first `--worker`; where it ran in several dtypes (a GGUF file), each peer is
compared with the run holding the weights the peer holds (vLLM: bfloat16; llama.cpp:
the file's own type). With a speculative config, kvscope's compared run is the one that
speculated (each peer's label says whether it did), and its tokens/s over its own run
without speculation is beside (`x_no_speculation`).
"""

from __future__ import annotations

import attrs

from .records import (
    EngineRun,
    Headline,
    Level,
    LevelHeadline,
    PeerLevelHeadline,
    ServedRun,
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


def peer_level(ours: Level | None, peer: Level | None) -> PeerLevelHeadline:
    ours_ttft, peer_ttft = _ttft(ours), _ttft(peer)
    return PeerLevelHeadline(
        kvscope_serve_tokens_per_s=_tps(ours),
        peer_tokens_per_s=_tps(peer),
        x_peer=_ratio(_tps(ours), _tps(peer)),
        kvscope_serve_ttft_p50_ms=ours_ttft,
        peer_ttft_p50_ms=peer_ttft,
        ttft_no_worse=None if ours_ttft is None or peer_ttft is None else ours_ttft <= peer_ttft,
    )


def compared_run(
    result: ThroughputResult, threads: int, peer: ServedRun | None
) -> ServedRun | None:
    """The kvscope serve run of `threads` that `peer` is compared with: of the first
    `--worker` given, the one holding the weights `peer` holds, else the first; with a
    speculative config, the one that speculated (whether the peer did is its label)."""
    runs = [r for r in result.kvscope_serve if r.threads == threads and r.speculative is not False]
    first_worker = [r for r in runs if r.worker == runs[0].worker] if runs else []
    weights = None if peer is None else peer.weights
    return next((r for r in first_worker if r.weights == weights), next(iter(first_worker), None))


def baseline_run(result: ThroughputResult, ours: ServedRun | None) -> ServedRun | None:
    """kvscope serve's run as `ours` but without speculation (None without a config)."""
    if ours is None or not ours.speculative:
        return None
    same = (ours.threads, ours.worker, ours.dtype, ours.weights)
    return next(
        (
            r
            for r in result.kvscope_serve
            if r.speculative is False and (r.threads, r.worker, r.dtype, r.weights) == same
        ),
        None,
    )


def with_baseline(level: LevelHeadline, baseline: Level | None) -> LevelHeadline:
    """`level` with kvscope serve's tokens/s without speculation beside, and the ratio."""
    if baseline is None:
        return level
    tps = baseline.tokens_per_s
    x = _ratio(level.kvscope_serve_tokens_per_s, tps)
    return attrs.evolve(level, no_speculation_tokens_per_s=tps, x_no_speculation=x)


def _of(runs: list[ServedRun], threads: int) -> ServedRun | None:
    return next((r for r in runs if r.threads == threads), None)


def llama_cpp_levels(
    result: ThroughputResult, ours: ServedRun | None, peer: ServedRun | None
) -> dict[str, PeerLevelHeadline]:
    if peer is None:
        return {}
    ours_levels = [] if ours is None else ours.levels
    return {
        str(c): peer_level(level_of(ours_levels, c), level_of(peer.levels, c))
        for c in result.config.concurrency
    }


def threads_headline(result: ThroughputResult, run: EngineRun) -> ThreadsHeadline:
    vllm_run, llama_run = _of(result.vllm, run.threads), _of(result.llama_cpp, run.threads)
    ours_vllm = compared_run(result, run.threads, vllm_run)
    ours_llama = compared_run(result, run.threads, llama_run) if llama_run else None
    served = [] if ours_vllm is None else ours_vllm.levels
    vllm = [] if vllm_run is None else vllm_run.levels
    baseline = baseline_run(result, ours_vllm)
    unsped = [] if baseline is None else baseline.levels
    base = ThreadsHeadline(
        levels={
            str(c): with_baseline(
                level_headline(level_of(served, c), level_of(vllm, c), level_of(run.levels, c)),
                level_of(unsped, c),
            )
            for c in result.config.concurrency
        },
        vllm_compared_with=None if ours_vllm is None else ours_vllm.label,
        vllm_run=None if vllm_run is None else vllm_run.named("vLLM CPU"),
        llama_cpp_compared_with=None if ours_llama is None else ours_llama.label,
        llama_cpp=llama_cpp_levels(result, ours_llama, llama_run),
    )
    hf = next((h for h in result.transformers if h.threads == run.threads), None)
    top = max(result.config.concurrency)
    ours_top = level_of(served, top) or level_of(run.levels, top)
    if hf is None or ours_top is None:
        return base
    one = hf.one_at_a_time.tokens_per_s
    x = _ratio(ours_top.tokens_per_s, one)
    return attrs.evolve(
        base,
        transformers_one_at_a_time_tokens_per_s=one,
        x_transformers_one_at_a_time=x,
        target_3x_transformers_met=(x or 0) >= 3,
    )


def headline(result: ThroughputResult) -> Headline:
    return Headline(
        concurrency=max(result.config.concurrency),
        by_threads={str(run.threads): threads_headline(result, run) for run in result.kvscope},
    )
