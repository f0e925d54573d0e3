"""The metrics read from the engine when Prometheus scrapes (the counters and
histograms fed by the engine's hooks are `metrics.py`'s).

`EngineGauges` reads `engine.stats()` once a scrape: KV blocks by state, queue depth,
running and live requests, requests a LoRA adapter, readiness, open streams, the
model's memory, worker restarts, the prefix cache's queries and hits, preemptions,
speculative decoding's drafts and accepted tokens.
`CheckpointGaps` exposes the runner's own histogram of the forward time between two
checkpoints (`execution/gaps.py`), which the forward's thread or process fills.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvscope import Engine

Family = GaugeMetricFamily | CounterMetricFamily


class EngineGauges(Collector):
    def __init__(self, engine: Engine, open_streams: Callable[[], int]) -> None:
        self._engine = engine
        self._open_streams = open_streams

    def collect(self) -> Iterator[Family]:
        stats = self._engine.stats()
        yield from _kv_blocks(stats)
        yield from self._requests(stats)
        yield from self._server(stats)
        yield from _prefix_cache(stats)
        yield from _speculation(stats, self._engine.step_statistics().spec_accepted_per_position)
        yield CounterMetricFamily(
            "kvscope_preemptions",
            "Sequences preempted (their blocks freed, to be computed again)",
            value=self._engine.step_statistics().preemptions,
        )

    def _requests(self, stats: dict[str, Any]) -> Iterator[Family]:
        yield GaugeMetricFamily(
            "kvscope_queue_depth", "Requests waiting for admission", value=stats["waiting"]
        )
        yield GaugeMetricFamily(
            "kvscope_requests_running", "Requests in the running batch", value=stats["running"]
        )
        yield GaugeMetricFamily(
            "kvscope_requests_live", "Requests not yet ended", value=stats["live_requests"]
        )
        adapters = GaugeMetricFamily(
            "kvscope_lora_requests",
            "Live requests running with each LoRA adapter served",
            labels=["adapter"],
        )
        for name, count in self._engine.adapter_requests().items():
            adapters.add_metric([name], count)
        yield adapters

    def _server(self, stats: dict[str, Any]) -> Iterator[Family]:
        warming = self._engine.waiting_for(stats)
        yield GaugeMetricFamily(
            "kvscope_ready",
            "1 once the server serves at full speed; 0 while a kernel build, the model"
            " worker's start or the warm-up is pending (GET /ready)",
            value=0 if warming else 1,
        )
        yield GaugeMetricFamily(
            "kvscope_open_streams",
            "Open SSE and WebSocket streams",
            value=self._open_streams(),
        )
        yield GaugeMetricFamily(
            "kvscope_engine_model_bytes",
            "Memory this process's copy of the model holds (0 once a model worker process"
            " has taken over)",
            value=stats["model_bytes"],
        )
        yield CounterMetricFamily(
            "kvscope_worker_restarts",
            "Model worker processes started to replace one that exited",
            value=stats["worker_restarts"],
        )


def _kv_blocks(stats: dict[str, Any]) -> Iterator[Family]:
    blocks = GaugeMetricFamily("kvscope_kv_blocks", "KV cache blocks by state", labels=["state"])
    for state in ("free", "in_use", "cached"):
        blocks.add_metric([state], stats[f"kv_blocks_{state}"])
    yield blocks
    yield GaugeMetricFamily(
        "kvscope_kv_blocks_total", "KV cache blocks in the pool", value=stats["kv_blocks_total"]
    )
    yield GaugeMetricFamily(
        "kvscope_kv_usage_ratio",
        "Fraction of KV blocks in use",
        value=stats["kv_blocks_in_use"] / max(1, stats["kv_blocks_total"]),
    )


def _prefix_cache(stats: dict[str, Any]) -> Iterator[Family]:
    yield CounterMetricFamily(
        "kvscope_prefix_cache_queries",
        "Prompt tokens admitted, each looked up in the prefix cache",
        value=stats["prompt_tokens_admitted"],
    )
    yield CounterMetricFamily(
        "kvscope_prefix_cache_hits",
        "Prompt tokens found computed at admission (a cached prefix, or a parent's)",
        value=stats["prompt_tokens_reused"],
    )


def _speculation(stats: dict[str, Any], per_position: tuple[int, ...]) -> Iterator[Family]:
    """Speculative decoding's counts (`actors/speculation.py`), all 0 with it off."""
    for name, what in (
        ("num_drafts", "Drafts verified (rows that proposed tokens in a step)"),
        ("num_draft_tokens", "Draft tokens proposed and verified"),
        ("num_accepted_tokens", "Draft tokens accepted"),
    ):
        yield CounterMetricFamily(
            f"kvscope_spec_decode_{name}", what, value=stats[f"spec_decode_{name}"]
        )
    by_position = CounterMetricFamily(
        "kvscope_spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the draft",
        labels=["position"],
    )
    for position, count in enumerate(per_position):
        by_position.add_metric([str(position)], count)
    yield by_position
    drafted = stats["spec_decode_num_draft_tokens"]
    yield GaugeMetricFamily(
        "kvscope_spec_decode_acceptance_rate",
        "Accepted draft tokens over those proposed, since the start (0 before any)",
        value=stats["spec_decode_num_accepted_tokens"] / drafted if drafted else 0.0,
    )


class CheckpointGaps(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[HistogramMetricFamily]:
        pairs, total = self._engine.runner.gaps.buckets()  # every runner keeps them
        yield HistogramMetricFamily(
            "kvscope_checkpoint_gap_seconds",
            "Forward time between two checkpoints (the longest a cancel waits for one)",
            buckets=[("+Inf" if b == float("inf") else str(b), c) for b, c in pairs],
            sum_value=total,
        )
