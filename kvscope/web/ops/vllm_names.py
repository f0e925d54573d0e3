"""vLLM's names for the metrics kvscope keeps under its own.

Grafana dashboards, autoscalers (KEDA, HPA adapters) and inference gateways (the
Gateway API inference extension, llm-d, vLLM's production stack) read a server's
`/metrics` by vLLM's names: `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:time_to_first_token_seconds`, ... `VllmNames` exposes a registry's families
as they are and then, for each one vLLM also has, a copy under vLLM's name, labelled
as vLLM labels it (`model_name`, `engine`). Nothing is counted twice: the copy is
made from the family at scrape time. Each name has one mapping, in `VLLM_NAMES`.
Two of vLLM's families have no kvscope family to copy, and are made from the engine:
`vllm:cache_config_info` and, while LoRA adapters are served, `vllm:lora_requests_info`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from kvscope import Engine

#: kvscope's family name -> vLLM's names for it (a counter's family name is without
#: `_total`): the current one first, then names vLLM used before (v0 and early V1),
#: which dashboards made then still read.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "kvscope_requests_running": ("vllm:num_requests_running",),
    "kvscope_queue_depth": ("vllm:num_requests_waiting",),
    "kvscope_kv_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "kvscope_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "kvscope_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "kvscope_preemptions": ("vllm:num_preemptions",),
    "kvscope_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "kvscope_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "kvscope_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "kvscope_spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ),
    "kvscope_prompt_tokens": ("vllm:prompt_tokens",),
    "kvscope_generation_tokens": ("vllm:generation_tokens",),
    "kvscope_requests": ("vllm:request_success",),
    "kvscope_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "kvscope_request_generation_tokens": ("vllm:request_generation_tokens",),
    "kvscope_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "kvscope_inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "kvscope_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "kvscope_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "kvscope_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "kvscope_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "kvscope_request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
}

#: kvscope's finish reasons in vLLM's words (`finished_reason`): a cancelled request
#: is vLLM's `abort`, a failed one its `error`.
VLLM_FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class VllmNames:
    """A registry's families, then vLLM's copies of those it names; pass it to
    `prometheus_client.generate_latest` in place of the registry."""

    def __init__(self, registry: Collector, engine: Engine) -> None:
        self._registry = registry
        self._labels = {"model_name": engine.model_name, "engine": "0"}
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        families = list(self._registry.collect())
        yield from families
        for family in families:
            for name in VLLM_NAMES.get(family.name, ()):
                yield self._renamed(family, name)
        yield self._cache_config_info()
        if self._engine.adapter_requests():
            yield self._lora_requests_info()

    def _renamed(self, family: Metric, name: str) -> Metric:
        copy = Metric(name, family.documentation, family.type)
        copy.samples = [
            Sample(
                name + sample.name[len(family.name) :],
                {**self._labels, **_vllm_labels(sample.labels)},
                sample.value,
                sample.timestamp,
                sample.exemplar,
            )
            for sample in family.samples
        ]
        return copy

    def _cache_config_info(self) -> Metric:
        """vLLM's `cache_config_info`: 1, with the cache's settings as labels (gateways
        read `block_size` from it to hash prompts as the server's prefix cache does)."""
        config = self._engine.config
        info = Metric("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
        labels = {
            "block_size": str(config.block_size),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "cache_dtype": "auto",
        }
        info.samples = [Sample(info.name, {**self._labels, **labels}, 1.0)]
        return info

    def _lora_requests_info(self) -> Metric:
        """vLLM's `lora_requests_info`: the scrape's time, with the adapters of running
        and of waiting requests as labels (gateways route a request to a server already
        running its adapter). `max_lora` is the number of adapters served: every one
        stays loaded, and any number share a step."""
        running, waiting = self._engine.scheduled_adapters()
        info = Metric("vllm:lora_requests_info", "Running stats on lora requests.", "gauge")
        labels = {
            "max_lora": str(len(self._engine.adapter_requests())),
            "waiting_lora_adapters": ",".join(waiting),
            "running_lora_adapters": ",".join(running),
        }
        info.samples = [Sample(info.name, labels, time.time())]
        return info


def _vllm_labels(labels: dict[str, str]) -> dict[str, str]:
    if "finish_reason" not in labels:
        return labels
    reason = labels["finish_reason"]
    rest: Iterable[tuple[str, str]] = ((k, v) for k, v in labels.items() if k != "finish_reason")
    return {**dict(rest), "finished_reason": VLLM_FINISH_REASONS.get(reason, reason)}
