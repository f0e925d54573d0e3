"""kvscope's side of `bench throughput`: the engine in-process, at several concurrencies.

Each level submits the workload's requests with at most `concurrency` in flight,
streams every request (recording time to first token and the gaps between tokens) and
reports output tokens/s over the level's wall time. A step listener and a timer around
the model's `forward` give the step loop's own overhead: the share of each step's wall
time (one step's start to the next's) spent outside the model forward (scheduling,
batch building, the thread hop, sampling, delivering tokens).
"""

from __future__ import annotations

import time

import anyio
import attrs

from kvscope import Engine
from kvscope.execution.runner import ModelRunner

from ..core.stats import summary
from ..core.workload import Workload
from .levels import Timing, level_figures
from .records import EngineRun, Level, StepOverhead


class StepRecorder:
    """Collects (start, runner seconds, batch, tokens, model seconds) per step; model
    seconds are the decoder's forward plus the LM head, timed in the worker thread."""

    def __init__(self, engine: Engine) -> None:
        self.rows: list[tuple[float, float, int, int, float]] = []
        self._model_seconds = 0.0
        self._tokens = 0
        runner = engine.step.runner
        # The forward is timed in this process: the engine runs with worker="thread".
        assert isinstance(runner, ModelRunner), "the step overhead needs the in-thread runner"
        model = runner.model
        forward, logits = model.forward, model.logits

        def timed_forward(input_ids, *args, **kwargs):  # runs in the worker thread
            t0 = time.perf_counter()
            try:
                return forward(input_ids, *args, **kwargs)
            finally:
                self._model_seconds = time.perf_counter() - t0
                self._tokens = int(input_ids.shape[0])

        def timed_logits(hidden, *args, **kwargs):  # the LM head is model compute too
            t0 = time.perf_counter()
            try:
                return logits(hidden, *args, **kwargs)
            finally:
                self._model_seconds += time.perf_counter() - t0

        model.forward, model.logits = timed_forward, timed_logits  # type: ignore[method-assign]  # instrumentation only
        engine.step_listeners.append(self._on_step)

    def _on_step(self, started: float, forward_seconds: float, batch: int) -> None:
        self.rows.append((started, forward_seconds, batch, self._tokens, self._model_seconds))

    def clear(self) -> None:
        self.rows.clear()

    def overhead(self, batch: int) -> StepOverhead | None:
        """Median figures over decode-only steps of `batch` sequences followed by another step."""
        walls, executes, models, shares = [], [], [], []
        for row, following in zip(self.rows, self.rows[1:], strict=False):
            started, execute, size, tokens, model = row
            if size != batch or tokens != batch:
                continue
            wall = following[0] - started
            if wall > 4 * execute + 0.05:  # the loop idled (waiting for a client), not a busy step
                continue
            walls.append(wall)
            executes.append(execute)
            models.append(model)
            shares.append(1 - model / wall)
        if not walls:
            return None
        return StepOverhead(
            batch=batch,
            steps=len(walls),
            step_ms=summary(walls, 1e3).p50,
            runner_ms=summary(executes, 1e3).p50,
            model_forward_ms=summary(models, 1e3).p50,
            outside_forward_share=summary(shares).p50,
            outside_forward_share_p90=summary(shares).p90,
            event_loop_share=summary([1 - e / w for e, w in zip(executes, walls, strict=True)]).p50,
        )


async def _one(
    engine: Engine,
    prompt: list[int],
    workload: Workload,
    limit: anyio.Semaphore,
    out: list[Timing],
) -> None:
    async with limit:
        t0 = time.perf_counter()
        times: list[float] = []
        tokens = 0
        async with engine.request(
            prompt, max_tokens=workload.max_tokens, ignore_eos=True, **workload.sampling
        ) as req:
            async for delta in req:
                if delta.token_ids:
                    times.append(time.perf_counter())
                    tokens += len(delta.token_ids)
        out.append(Timing(t0, times, tokens))


async def run_level(engine: Engine, workload: Workload, concurrency: int, timeout: float) -> Level:
    limit = anyio.Semaphore(concurrency)
    records: list[Timing] = []
    t0 = time.perf_counter()
    with anyio.fail_after(timeout):
        async with anyio.create_task_group() as tg:
            for prompt in workload.prompts:
                tg.start_soon(_one, engine, prompt, workload, limit, records)
    wall = time.perf_counter() - t0
    return level_figures(concurrency, records, wall)


async def run_engine(
    model: str,
    threads: int,
    levels: list[tuple[int, Workload]],
    *,
    dtype: str,
    timeout: float,
    warmup_tokens: int = 8,
    speculative_config: str | None = None,
) -> EngineRun:
    """All concurrency levels on one engine with `threads` torch threads (and the
    speculative config, vLLM's JSON, where given)."""
    max_seqs = max(c for c, _ in levels)
    results = []
    overhead: dict[str, StepOverhead] = {}
    async with Engine.open(
        model,
        device="cpu",
        dtype=dtype,
        model_threads=threads,
        max_num_seqs=max(max_seqs, 1),
        worker="thread",  # `StepRecorder` times the forward in this process
        speculative_config=speculative_config,
    ) as engine:
        recorder = StepRecorder(engine)
        warm = levels[0][1].prompts[0]
        await engine.generate(warm, temperature=0, max_tokens=warmup_tokens, ignore_eos=True)
        for concurrency, workload in levels:
            recorder.clear()
            level = await run_level(engine, workload, concurrency, timeout)
            results.append(level)
            figures = recorder.overhead(concurrency)
            if figures is not None:
                overhead[str(concurrency)] = figures
            print(
                f"  kvscope threads={threads} concurrency={concurrency}: "
                f"{level.tokens_per_s:.0f} tok/s, ITL p50 {level.itl_ms.p50} ms",
                flush=True,
            )
        stats = engine.stats()
        stats = stats if isinstance(stats, dict) else attrs.asdict(stats)
    return EngineRun(
        threads=threads,
        levels=results,
        step_overhead=overhead,
        stats_after=stats,
        speculative=None if speculative_config is None else True,
    )
