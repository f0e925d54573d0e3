"""The records of `bench throughput` (written to the JSON, read back by `bench report`).

A `Level` is one concurrency's figures, the same for the engine in-process and for a
served system over HTTP (only the latter has the client's CPU). Fields added after the
first recorded files (cold start, settings, load average) default to None.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..core.machine import Machine
from ..core.records import FORMAT, Record
from ..core.servers import ServerSettings
from ..core.stats import Summary


@attrs.frozen(kw_only=True)
class Level(Record):
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_ms: Summary
    itl_ms: Summary
    #: The HTTP client's own CPU seconds over the level, and their share of the machine.
    client_cpu_s: float | None = None
    client_cpu_share: float | None = None


def level_of(levels: list[Level], concurrency: int) -> Level | None:
    return next((lv for lv in levels if lv.concurrency == concurrency), None)


@attrs.frozen(kw_only=True)
class StepOverhead(Record):
    """Medians over decode-only steps of one batch size (see `engine_run`)."""

    batch: int
    steps: int
    step_ms: float | None
    runner_ms: float | None
    model_forward_ms: float | None
    outside_forward_share: float | None
    outside_forward_share_p90: float | None
    event_loop_share: float | None


@attrs.frozen(kw_only=True)
class EngineRun(Record):
    threads: int
    levels: list[Level]
    step_overhead: dict[str, StepOverhead]
    #: `engine.stats()` after the last level.
    stats_after: dict[str, Any]
    #: As `ServedRun.speculative` (the engine runs with the config where one is given).
    speculative: bool | None = None


@attrs.frozen(kw_only=True)
class ColdStart(Record):
    """Seconds from spawning the server to its answering, to its first token, and (a
    server that finishes starting while it serves, as `kvscope serve` does: its model
    worker process, or the thread worker's warm-up) to its being fully up, which the
    levels wait for; None where nothing is left to wait for."""

    ready_s: float
    first_token_s: float
    fully_up_s: float | None = None


@attrs.frozen(kw_only=True)
class LoadAround(Record):
    before: list[float] | None
    after: list[float] | None


@attrs.frozen(kw_only=True)
class ServedRun(Record):
    threads: int
    levels: list[Level]
    cold_start: ColdStart | None = None
    settings: ServerSettings | None = None
    load_average: LoadAround | None = None
    #: `kvscope serve --worker` (thread or process); None for vLLM, and in files written
    #: before it was recorded (those ran the thread worker).
    worker: str | None = None
    #: The server's child processes still there once it exited on SIGTERM (None in
    #: older files).
    processes_left: int | None = None
    #: The `--dtype` the server was given: kvscope serve's, vLLM's (None for llama.cpp,
    #: which serves the file as it is, and in older files).
    dtype: str | None = None
    #: How the server held the weights, where the model is a GGUF file: the file's
    #: type (`Q4_1`, kvscope under `--dtype auto`, and llama.cpp) or the float type
    #: they were dequantized to (`bfloat16`); None for a checkpoint directory.
    weights: str | None = None
    #: Whether the server ran with the run's `Config.speculative_config` (True) or
    #: without it (False); None in a run without one, and in older files.
    speculative: bool | None = None
    #: The server's `vllm:spec_decode_*` counters after the levels (kvscope serve and
    #: vLLM name them alike; the warm-up request included), where it speculated.
    spec_decode: dict[str, int] | None = None

    @property
    def label(self) -> str:
        """kvscope serve's name in the tables, with its worker where the file says
        (files from before it was recorded ran the thread worker, unnamed)."""
        name = "kvscope serve" if self.worker is None else f"kvscope serve, {self.worker} worker"
        return self.named(name)

    def named(self, system: str) -> str:
        """`system`, with the weights and the speculation where they are recorded."""
        held = system if self.weights is None else f"{system}, {self.weights}"
        return with_speculation(held, self.speculative)


def with_speculation(name: str, speculative: bool | None) -> str:
    """`name` with whether it speculated, where the run has a speculative config."""
    if speculative is None:
        return name
    return f"{name}, {'speculative' if speculative else 'no speculation'}"


#: The serving path may cost this much of the in-process tokens/s (docs/benchmarks/README.md,
#: "Throughput beside vLLM and llama.cpp").
SERVED_COST_LIMIT = 0.05


@attrs.frozen(kw_only=True)
class PairedLevel(Record):
    """One concurrency of the interleaved phase (`paired.py`), round by round."""

    concurrency: int
    engine_tokens_per_s: list[float]
    served_tokens_per_s: list[float]
    #: Served over in-process, round by round, and their median.
    ratios: list[float]
    ratio_median: float

    @property
    def within_limit(self) -> bool:
        return self.ratio_median >= 1 - SERVED_COST_LIMIT


@attrs.frozen(kw_only=True)
class PairedRun(Record):
    threads: int
    worker: str
    rounds: int
    levels: list[PairedLevel]
    #: As `ServedRun.speculative` (both sides run with the config where one is given).
    speculative: bool | None = None


@attrs.frozen(kw_only=True)
class HfOneAtATime(Record):
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float


@attrs.frozen(kw_only=True)
class HfBatch(Record):
    batch: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float


@attrs.frozen(kw_only=True)
class HfRun(Record):
    threads: int
    one_at_a_time: HfOneAtATime
    static_batch: list[HfBatch]


@attrs.frozen(kw_only=True)
class Config(Record):
    model: str
    dtype: str
    #: The random workload's prompt length (None for the reuse workload, whose prompts
    #: are as long as their chats: `prompt_tokens_range`).
    prompt_tokens: int | None
    max_tokens: int
    concurrency: list[int]
    requests_per_level: dict[str, int]
    threads: list[int]
    hf_requests: int
    temperature: float = 0
    top_p: float = 1.0
    ignore_eos: bool = True
    #: The Hugging Face directory vLLM and transformers ran (`--peer-model`), where
    #: `model` is a GGUF file; and how that file holds its weights (`Q4_1`).
    peer_model: str | None = None
    model_weights: str | None = None
    #: `--workload`: random (distinct random-token prompts) or reuse (chats asking to
    #: repeat a code snippet; `core/reuse_workload.py`); files before it: random.
    workload: str = "random"
    #: The shortest and longest prompt, in tokens, over every level.
    prompt_tokens_range: list[int] | None = None
    #: `--speculative-config` as given (vLLM's JSON), None without it; which runs had it
    #: is each run's `speculative`.
    speculative_config: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class LevelHeadline(Record):
    """kvscope served against vLLM served at one concurrency (the engine beside)."""

    engine_tokens_per_s: float | None
    kvscope_serve_tokens_per_s: float | None
    vllm_tokens_per_s: float | None
    kvscope_serve_ttft_p50_ms: float | None
    vllm_ttft_p50_ms: float | None
    x_vllm: float | None
    target_vllm_met: bool | None = None
    ttft_no_worse: bool | None = None
    #: With a speculative config: kvscope serve's same run without it, and the compared
    #: run's tokens/s over it (issue 50: >= 1.8 at one stream on the reuse workload).
    no_speculation_tokens_per_s: float | None = None
    x_no_speculation: float | None = None


@attrs.frozen(kw_only=True)
class PeerLevelHeadline(Record):
    """kvscope served against another served peer (llama.cpp) at one concurrency."""

    kvscope_serve_tokens_per_s: float | None
    peer_tokens_per_s: float | None
    #: kvscope's tokens/s over the peer's.
    x_peer: float | None
    kvscope_serve_ttft_p50_ms: float | None
    peer_ttft_p50_ms: float | None
    ttft_no_worse: bool | None = None


@attrs.frozen(kw_only=True)
class ThreadsHeadline(Record):
    levels: dict[str, LevelHeadline]
    transformers_one_at_a_time_tokens_per_s: float | None = None
    x_transformers_one_at_a_time: float | None = None
    target_3x_transformers_met: bool | None = None
    #: The kvscope serve row compared with vLLM (in `levels`) and with llama.cpp.
    vllm_compared_with: str | None = None
    llama_cpp_compared_with: str | None = None
    #: The vLLM run compared (its speculation said where the run has a config).
    vllm_run: str | None = None
    llama_cpp: dict[str, PeerLevelHeadline] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class Headline(Record):
    concurrency: int
    by_threads: dict[str, ThreadsHeadline]


@attrs.frozen(kw_only=True)
class ThroughputResult(Record):
    machine: Machine
    config: Config
    #: The engine in-process, per thread count (never the target, shown beside it).
    kvscope: list[EngineRun]
    #: Peers that could not run, and why.
    missing: dict[str, str] = attrs.field(factory=dict)
    kvscope_serve: list[ServedRun] = attrs.field(factory=list)
    vllm: list[ServedRun] = attrs.field(factory=list)
    #: llama.cpp's `llama-server` on the same GGUF file.
    llama_cpp: list[ServedRun] = attrs.field(factory=list)
    transformers: list[HfRun] = attrs.field(factory=list)
    #: `kvscope serve` and the engine in-process, interleaved (absent in older files).
    paired: list[PairedRun] = attrs.field(factory=list)
    elapsed_s: float | None = None
    headline: Headline | None = None
    benchmark: str = "throughput"
    format: int = FORMAT
