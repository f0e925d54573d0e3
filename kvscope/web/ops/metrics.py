"""Prometheus metrics for one server, in a registry of its own.

Request-level figures come from the engine's release hook (called once per request when
its KV blocks are back in the pool): counts by finish reason and by cancel reason,
time to first token, inter-token latency, cancel-to-release latency, token counts.
Step figures come from the step hook; what is read from the engine at scrape time
(KV blocks, queue depth, running, the checkpoint gaps) is `engine_gauges.py`'s.
`monitor_loop_lag` is a small task that samples
how late the event loop serves a descriptor that became ready (`loop_lag`): the lag a
request arriving on a socket suffers too.

Every figure vLLM also exposes goes out a second time under vLLM's name
(`vllm_names.py`), so dashboards, autoscalers and gateways written for vLLM read
kvscope as they are.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvscope import Engine
from kvscope.actors.request import RequestState

from .engine_gauges import CheckpointGaps, EngineGauges
from .loop_lag import LagProbe
from .vllm_names import VllmNames

log = logging.getLogger("kvscope.web")

_LATENCY = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Fine up to 5 ms, where the loop lag's and the release's targets lie: a quantile is
#: read by interpolating inside its bucket, and with one bucket from 2.5 to 5 ms a p99
#: that fell anywhere in it read as 4-5 ms.
_FAST = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0015,
    0.002,
    0.0025,
    0.003,
    0.0035,
    0.004,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


#: A request's whole life and its phases (vLLM's request-latency buckets, to 2 hours).
_REQUEST = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
#: Token counts: 1, 2, 5, 10, 20, 50, ... up to a million.
_TOKENS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))


class _FastHistogram(Collector):
    """A histogram fed on the release hook: one value (`observe`), or all of a request's
    inter-token gaps at once (`observe_all`), one bisect each. prometheus_client's
    `Histogram.observe` takes a lock and walks the buckets for every value (2.4 us here): 0.3 ms for a request of 128 tokens, spent in
    its cleanup on the event loop, where a DELETE's answer waits for it (measured under
    load: 0.1-0.26 ms of the DELETE's path) and where 32 requests that end in one step
    stalled the loop for ~10 ms together. Exposed exactly as a `Histogram` is, less
    its `_created` sample."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def observe_all(self, values: Sequence[float]) -> None:
        counts, bounds = self._counts, self._bounds
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # a bucket's bound is inclusive
        self._sum += sum(values)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        buckets, cumulative = [], 0
        for bound, count in zip((*self._bounds, math.inf), self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(
            self._name, self._documentation, buckets=buckets, sum_value=self._sum
        )


class Metrics:
    """The server's metrics; `attach(engine)` hooks them to the engine."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvscope_requests", "Ended requests by finish reason", ["finish_reason"], registry=r
        )
        self.cancellations = Counter(
            "kvscope_cancellations", "Cancelled requests by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvscope_prompt_tokens", "Prompt tokens of ended requests", registry=r
        )
        self.generated_tokens = Counter(
            "kvscope_generation_tokens", "Generated tokens of ended requests", registry=r
        )
        self.ttft = Histogram(
            "kvscope_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = self._fast(
            "kvscope_inter_token_latency_seconds", "Time between tokens", _LATENCY
        )
        self.e2e = self._fast(
            "kvscope_e2e_request_latency_seconds",
            "From a request's arrival to its end (its blocks released)",
            _REQUEST,
        )
        self.queue_time = self._fast(
            "kvscope_request_queue_time_seconds",
            "From a request's arrival to its first admission to a step",
            _REQUEST,
        )
        self.prefill_time = self._fast(
            "kvscope_request_prefill_time_seconds",
            "From a request's first admission to its first token",
            _REQUEST,
        )
        self.decode_time = self._fast(
            "kvscope_request_decode_time_seconds",
            "From a request's first token to its last",
            _REQUEST,
        )
        self.inference_time = self._fast(
            "kvscope_request_inference_time_seconds",
            "From a request's first admission to its last token",
            _REQUEST,
        )
        self.request_prompt_tokens = self._fast(
            "kvscope_request_prompt_tokens", "Prompt tokens per ended request", _TOKENS
        )
        self.request_generation_tokens = self._fast(
            "kvscope_request_generation_tokens", "Generated tokens per ended request", _TOKENS
        )
        self.cancel_release = Histogram(
            "kvscope_cancel_to_release_seconds",
            "From the cancel call to the KV blocks' release",
            buckets=_FAST,
            registry=r,
        )
        self.step_seconds = Histogram(
            "kvscope_step_forward_seconds",
            "Model forward time per step",
            buckets=_LATENCY,
            registry=r,
        )
        self.loop_lag = Histogram(
            "kvscope_event_loop_lag_seconds",
            "From a descriptor becoming ready to the event loop serving it",
            buckets=_FAST,
            registry=r,
        )
        self.open_streams = 0
        #: Tokens generated by ended requests (`tokens_generated_total` in /stats).
        self.tokens_total = 0
        self._exposed: CollectorRegistry | VllmNames = self.registry

    def _fast(self, name: str, documentation: str, bounds: Sequence[float]) -> _FastHistogram:
        histogram = _FastHistogram(name, documentation, bounds)
        self.registry.register(histogram)
        return histogram

    def attach(self, engine: Engine) -> None:
        self.registry.register(EngineGauges(engine, lambda: self.open_streams))
        self.registry.register(CheckpointGaps(engine))
        self._exposed = VllmNames(self.registry, engine)
        engine.release_listeners.append(self._on_release)
        engine.step_listeners.append(self._on_step)

    def _on_release(self, state: RequestState) -> None:
        try:
            self.requests.labels(state.finish_reason or "cancelled").inc()
            if state.finish_reason == "cancelled":
                self.cancellations.labels(state.cancel_reason or "unknown").inc()
                if state.cancel_called_at is not None and state.released_at is not None:
                    self.cancel_release.observe(
                        max(0.0, state.released_at - state.cancel_called_at)
                    )
            self.prompt_tokens.inc(len(state.prompt_ids))
            self.generated_tokens.inc(len(state.token_ids))
            self.tokens_total += len(state.token_ids)
            self.request_prompt_tokens.observe(len(state.prompt_ids))
            self.request_generation_tokens.observe(len(state.token_ids))
            if state.released_at is not None:
                self.e2e.observe(state.released_at - state.created)
            admitted = state.seq.first_admitted_at
            if admitted is not None:
                self.queue_time.observe(admitted - state.created)
            times = state.token_times
            if state.first_token_at is not None:
                self.ttft.observe(state.first_token_at - state.created)
                self.decode_time.observe(times[-1] - state.first_token_at)
                if admitted is not None:
                    self.prefill_time.observe(state.first_token_at - admitted)
                    self.inference_time.observe(times[-1] - admitted)
            gaps = [after - before for before, after in zip(times, times[1:], strict=False)]
            self.itl.observe_all(gaps)
        except Exception:  # a metrics bug must never break the engine's cleanup
            log.exception("metrics: release hook failed for %s", state.id)

    def _on_step(self, started: float, forward_seconds: float, batch: int) -> None:
        self.step_seconds.observe(forward_seconds)

    def render(self) -> bytes:
        return generate_latest(self._exposed)  # type: ignore[arg-type]

    async def monitor_loop_lag(self, interval: float) -> None:
        """Forever: every `interval`, record how late the loop served a descriptor
        that became ready (`loop_lag.LagProbe`)."""
        await LagProbe(self.loop_lag.observe).run(interval)

    def snapshot(self) -> dict[str, Any]:
        return {"tokens_generated_total": self.tokens_total, "open_streams": self.open_streams}
