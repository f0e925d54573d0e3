"""The engine: the root nursery, the registry of requests, and the public Python API.

`Engine.open()` loads the model, opens the root task group and starts the model worker
(with `worker="process"`) and the step actor in it (`await tg.start`, so nothing is
served before the model is ready). Each request is a task in that group (or in its
parent's group) running `lifecycle.run_request`, which owns the request's whole end of
life; the engine only starts it (after `admission.py` says it may) and cancels it.
Closing the engine cancels every live request with reason `shutdown`, stops the
running forward, and returns only when every task has ended and every block is back in
the pool.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from kvscope.errors import EngineClosed, InvalidRequest, RequestConflict, UnknownRequest
from kvscope.kernels.guided import GuideCompiler
from kvscope.params import ContextPolicy, SamplingParams

from .adapters import RuntimeAdapters
from .admission import Admission
from .audit import AuditLog
from .cancelling import cancel_and_report, cancel_tree
from .handles import DeltaStream, Job, Request
from .lifecycle import Actors, Ledger, run_request
from .messages import CancelReport, Completion, RequestInfo, RequestStatus, StepStatistics
from .parts import Parts, load_parts, run_worker
from .readiness import waiting_for
from .registry import Registry
from .request import RequestState
from .request_views import info_of
from .spec import Prompt, RequestSpec
from .statistics import engine_stats
from .step import StepActor

log = logging.getLogger("kvscope.requests")

T = TypeVar("T")


class Engine:
    """An open engine. Create it with `async with Engine.open(...) as engine`."""

    def __init__(self, parts: Parts) -> None:
        self.loaded = parts.loaded
        self.config = config = parts.config
        self.device = parts.device
        self.tokenizer = parts.loaded.tokenizer
        self.pool, self.scheduler, self.runner = parts.pool, parts.scheduler, parts.runner
        self.kv_cache = parts.kv_cache
        self.registry = Registry(config.finished_history, config.finished_history_bytes)
        self.ledger = Ledger()
        self.lora = RuntimeAdapters(parts, self.ledger)
        self.admission = Admission(
            parts.loaded, config, self.scheduler, self.registry, self.ledger, parts.adapters
        )
        #: Called after each step with (start time, forward seconds, batch size).
        self.step_listeners: list[Callable[[float, float, int], None]] = []
        self.step = StepActor(
            self.scheduler,
            self.runner,
            self.pool,
            debug=config.debug,
            on_step=self._after_step,
            warm_up=parts.warm_up,
            speculative=config.speculative_config,
        )
        self._worker = parts.worker
        self.audit = AuditLog(config.audit_log)
        self._actors = Actors(self.scheduler, self.step, self.registry, self.audit, self.ledger)
        self._tg: TaskGroup | None = None
        self._accepting = True

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: str = "bundled",
        *,
        device: str = "auto",
        dtype: str = "auto",
        **config: Any,
    ) -> AsyncIterator[Engine]:
        """Load `model` and run an engine for the duration of the block."""
        engine = cls(await load_parts(model, device, dtype, config))
        log.info(
            "engine open model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
            engine.loaded.name,
            engine.device,
            engine.loaded.model.dtype,
            engine.pool.num_blocks,
            engine.config.block_size,
            engine.max_model_len,
        )
        try:
            async with anyio.create_task_group() as tg:
                engine._tg = tg
                if engine._worker is not None:
                    await tg.start(run_worker, engine._worker)
                await tg.start(engine.step.run)
                try:
                    yield engine
                finally:
                    engine._shutdown()
        except BaseExceptionGroup as group:
            # Request tasks end by returning, and the step actor turns a model failure
            # into failed requests, so a lone exception is most likely the caller's own,
            # from the body of the `async with`: give it back unwrapped.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            engine._closed()

    def _shutdown(self) -> None:
        self._accepting = False
        for state in self.registry.live():
            state.cancel("shutdown", by="engine")
        self.step.stop_forward()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    def _closed(self) -> None:
        stats = self.pool.stats()
        self.pool.check_integrity()
        if stats.in_use:
            log.error("engine closed with %d KV blocks still in use", stats.in_use)
        self.audit.close()
        log.info("engine closed: %s", self.stats())

    async def drain(self, timeout: float) -> bool:
        """Stop taking requests and wait up to `timeout` s for the live ones to end."""
        self._accepting = False
        with anyio.move_on_after(timeout):
            await self.ledger.idle.wait()
        return self.registry.num_live == 0

    async def wait_idle(self) -> None:
        """Wait until no request is live."""
        await self.ledger.idle.wait()

    # -- starting requests ---------------------------------------------------------------
    # Options (`priority`, `parent`, `request_id`, `timeout`, `owner`, and any
    # `SamplingParams` field) are the same for all four; see `spec.RequestSpec`.

    @asynccontextmanager
    async def request(
        self, prompt: Prompt, params: SamplingParams | None = None, **options: Any
    ) -> AsyncIterator[Request]:
        """A request that lives as long as the block: iterate it for `Delta`s; leaving
        the block early (break, exception, the caller's scope cancelled) cancels it."""
        state = await self._start(RequestSpec.build(prompt, params, options))
        try:
            yield Request(state)
        finally:
            cancel_tree(state, "scope", None)
            # Leaving the block means the request (and its children) ended and its
            # blocks are free; a step in flight drops it at its next checkpoint.
            with anyio.CancelScope(shield=True):
                await state.task_done.wait()

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, **options: Any
    ) -> Completion:
        """Run a request to its end and return its `Completion`."""
        async with self.request(prompt, params, **options) as request:
            return await request.wait()

    async def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, **options: Any
    ) -> Job:
        """Start a detached request; it runs until it ends or is cancelled by id."""
        return Job(await self._start(RequestSpec.build(prompt, params, options)))

    async def submit_samples(
        self, prompt: Prompt, params: SamplingParams | None = None, *, n: int, **options: Any
    ) -> list[Job]:
        """Start `n` samples of one prompt as one family (OpenAI's `n`): sample 0 is the
        parent, the others its children, all started before any can end, so they share
        the prompt's KV blocks and cancelling sample 0 cancels them all. With a seed,
        sample i uses seed + i."""
        if "parent" in options or "samples" in options:
            raise InvalidRequest("samples take neither a parent nor `samples` (use n)")
        state = await self._start(RequestSpec.build(prompt, params, {**options, "samples": n}))
        return [Job(state), *(Job(child) for child in state.children)]

    async def encode(self, prompt: Prompt) -> list[int]:
        """`prompt` (text or token ids) as the token ids a request of it would run,
        checked as a request's prompt is (`InvalidRequest` if it cannot run)."""
        return await self.admission.encode(prompt)

    async def _start(self, spec: RequestSpec) -> RequestState:
        if not self._accepting or self._tg is None:
            raise EngineClosed("the engine is shutting down")
        params, prompt_ids = await self.admission.prepare(spec)
        # From here to the task's start nothing awaits, so the checks and the counts
        # they guard cannot interleave with another request's.
        if not self._accepting:
            raise EngineClosed("the engine is shutting down")
        state, group = self.admission.admit(spec, params, prompt_ids, self._tg)
        # Shielded: once the task exists, the caller must get its handle to own it.
        with anyio.CancelScope(shield=True):
            try:
                await group.start(run_request, state, self._actors)
            except RuntimeError as exc:  # the parent's group closed meanwhile
                self.admission.unadmit(state, spec.samples)
                raise RequestConflict(f"parent request {spec.parent!r} has ended") from exc
        return state

    # -- LoRA adapters at run time -------------------------------------------------------

    def adapter_requests(self) -> dict[str, int]:
        """Each LoRA adapter served, and how many live requests run with it."""
        return self.lora.requests()

    def scheduled_adapters(self) -> tuple[list[str], list[str]]:
        """The LoRA adapters of the running requests, and of the waiting ones (vLLM's
        `running_lora_adapters` and `waiting_lora_adapters`)."""
        running, waiting = self.scheduler.adapters()
        return sorted(running), sorted(waiting)

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter saved in `path` as `name` from now on (vLLM's runtime
        loading; `adapters.RuntimeAdapters.load`)."""
        await self.lora.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving the LoRA adapter `name` (`adapters.RuntimeAdapters.unload`)."""
        self.lora.unload(name)

    # -- cancelling ---------------------------------------------------------------------

    async def cancel(
        self, request_id: str, reason: str = "user", by: str | None = None
    ) -> CancelReport:
        """Cancel a request and its children; returns once its blocks are released."""
        return await cancel_and_report(self.registry, request_id, reason, by)

    def cancel_nowait(self, request_id: str, reason: str = "user", by: str | None = None) -> bool:
        """Cancel without waiting (for `finally` blocks); False if unknown or ended."""
        state = self.registry.get(request_id)
        return state is not None and cancel_tree(state, reason, by)

    # -- looking ------------------------------------------------------------------------

    def get(self, request_id: str) -> RequestInfo | None:
        state = self.registry.get(request_id)
        return info_of(state) if state is not None else None

    def list_requests(self, owner: str | None = None) -> list[RequestInfo]:
        return [info_of(state) for state in self.registry.live(owner)]

    def watch(self, request_id: str) -> DeltaStream:
        """The deltas of a request from its start; watching cancels nothing."""
        state = self.registry.get(request_id)
        if state is None:
            raise UnknownRequest(f"no request {request_id!r}")
        return DeltaStream(state)

    def stats(self) -> dict[str, int]:
        return engine_stats(self._actors)

    def waiting_for(self, stats: dict[str, int] | None = None) -> tuple[str, ...]:
        """What it still waits for before it serves at full speed (`readiness.py`: a
        kernel build, the model worker's start, the warm-up); empty once it does.
        `stats`: this engine's `stats()`, where the caller has them already."""
        return waiting_for(
            self.device, self.config.worker, self.stats() if stats is None else stats
        )

    def step_statistics(self) -> StepStatistics:
        """What the step actor is doing: steps, aborted steps, preemptions, and which
        requests are in the running step."""
        return self.step.statistics()

    @property
    def before_forward(self) -> list[Callable[[], None]]:
        """Called in the model's thread right before each step's forward (tests)."""
        return self.step.before_forward

    def check_integrity(self) -> None:
        """Assert the block pool's invariants (free + in use + cached = total, ...)."""
        self.pool.check_integrity()

    def audit_records(self) -> list[dict[str, Any]]:
        return list(self.audit.records)

    @property
    def release_listeners(self) -> list[Callable[[RequestState], None]]:
        """Called with each request's state once it is released (metrics)."""
        return self.ledger.release_listeners

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters requests may run with (`SamplingParams.lora`): each name's
        directory."""
        return dict(self.lora.table)

    @property
    def max_model_len(self) -> int:
        return self.admission.max_model_len

    @property
    def max_prompt_bytes(self) -> int:
        return self.admission.max_prompt_bytes

    @property
    def guides(self) -> GuideCompiler:
        return self.admission.guides

    async def encode_text(
        self, text: str, *, add_special_tokens: bool = True, field: str = "prompt"
    ) -> list[int]:
        return await self.admission.encode_text(
            text, add_special_tokens=add_special_tokens, field=field
        )

    def fit(self, prompt_len: int, max_tokens: int, context: ContextPolicy = "cap") -> int:
        """The `max_tokens` a request of `prompt_len` prompt tokens would run with, under
        the `context` policy (`InvalidRequest` if it would be refused): admission's rule,
        for a client that runs its own requests (beam search)."""
        return self.admission.fit(prompt_len, max_tokens, context)

    async def run_off_loop(self, size: int, work: Callable[[], T]) -> T:
        return await self.admission.run_off_loop(size, work)

    def _after_step(self, started: float, forward_seconds: float, batch: int) -> None:
        for listener in self.step_listeners:
            listener(started, forward_seconds, batch)


__all__ = ["Engine", "RequestStatus"]
