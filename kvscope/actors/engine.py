"""The engine: the root nursery that owns the model, the cache, the step actor and
every request task, and the public Python API over them.

`Engine.open()` loads the model, opens the root task group and starts the step actor
in it (`await tg.start`, so nothing is served before the model is ready). Each request
is a task in that group (or in its parent's group) running `run_request`. Closing the
engine cancels every live request with reason `shutdown`, aborts the running forward,
and returns only when every task has ended and every block is back in the pool.

The engine is also the request tasks' `RequestCore`: `open_request` queues a request,
`close_request` is its synchronous cleanup (leave the scheduler, drop block references,
publish the end) and `_release` runs when its blocks are actually free (at once, or
when the running step unpins them), writing the audit line.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import attrs
import torch
from anyio.abc import TaskGroup, TaskStatus

from kvscope.cache.block_pool import BlockPool
from kvscope.cache.kv_cache import KVCache
from kvscope.config import PROMPT_BYTES_PER_TOKEN, EngineConfig
from kvscope.errors import (
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
    RequestConflict,
    UnknownRequest,
)
from kvscope.kernels.device import select_device
from kvscope.kernels.guided import GuideCompiler
from kvscope.kernels.sampling import make_generator
from kvscope.models.loader import LoadedModel, load_model
from kvscope.models.runner import ModelRunner
from kvscope.models.worker import ProcessRunner, WorkerDied, WorkerSpec
from kvscope.params import SamplingParams
from kvscope.text import utf8_size

from .audit import AuditLog
from .handles import DeltaStream, Job, Request
from .messages import CancelReport, Completion, RequestInfo, RequestStatus
from .registry import Registry, new_request_id
from .request import RequestState, run_request
from .scheduler import Scheduler, Sequence
from .step import StepActor

log = logging.getLogger("kvscope.requests")

Prompt = str | list[int]
T = TypeVar("T")


class Engine:
    """An open engine. Create it with `async with Engine.open(...) as engine`."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        device: torch.device,
        worker: WorkerSpec | None = None,
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.device = device
        self.tokenizer = loaded.tokenizer
        model_config = loaded.config
        self.guides = GuideCompiler(self.tokenizer, model_config.vocab_size)  # structured output
        num_blocks = config.num_kv_blocks or math.ceil(config.kv_cache_tokens / config.block_size)
        self.pool = BlockPool(num_blocks, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pool,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            watermark=config.watermark,
        )
        # One sequence must always fit in the pool beside the watermark, or it could
        # never finish; cap the context to what the pool holds.
        fits = (num_blocks - self.scheduler.watermark_blocks) * config.block_size
        if fits <= 0:
            raise InvalidRequest(
                f"a pool of {num_blocks} KV blocks leaves no room beside its watermark"
            )
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
            fits,
        )
        self.max_prompt_bytes = config.max_prompt_bytes or (
            PROMPT_BYTES_PER_TOKEN * self.max_model_len
        )
        # Tokenizing has its own threads: a flood of big prompts must never hold up the
        # step actor's thread (which takes the default limiter's).
        self._tokenize_limiter = anyio.CapacityLimiter(2)
        #: Sequences that passed admission but are not in the scheduler's queue yet.
        self._admitting = 0
        self.kv_cache = KVCache(
            num_layers=model_config.num_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=loaded.model.dtype,
            device=device,
        )
        # The forward runs in a worker thread, or, given a spec, in a model worker process.
        local = ModelRunner(loaded.model, self.kv_cache)
        self.runner = local if worker is None else ProcessRunner(worker, local, config.max_num_seqs)
        self.step = StepActor(
            self.scheduler,
            self.runner,
            self.pool,
            debug=config.debug,
            on_released=lambda seq: self._release(seq.owner),  # type: ignore[arg-type]
            on_step=self._after_step,
        )
        self.registry = Registry(config.finished_history, config.finished_history_bytes)
        self.audit = AuditLog(config.audit_log)
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(config.seed)
        self._tg: TaskGroup | None = None
        self._accepting = True
        self._closing = False
        self._idle = anyio.Event()
        self._idle.set()
        self._request_tasks = 0
        #: Called with each request's state once its blocks are released (metrics).
        self.release_listeners: list[Callable[[RequestState], None]] = []
        #: Called after each step with (start time, forward seconds, batch size).
        self.step_listeners: list[Callable[[float, float, int], None]] = []

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
        engine_config = EngineConfig.from_kwargs(**config)
        torch_device = select_device(device)
        if engine_config.model_threads:
            torch.set_num_threads(engine_config.model_threads)
        loaded = await anyio.to_thread.run_sync(
            lambda: load_model(model, device=torch_device, dtype=dtype, seed=engine_config.seed)
        )
        worker = None
        if engine_config.worker == "process":
            threads = engine_config.model_threads
            worker = WorkerSpec(model, str(torch_device), dtype, engine_config.seed, threads)
        engine = cls(loaded, engine_config, torch_device, worker)
        log.info(
            "engine open model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
            loaded.name,
            torch_device,
            loaded.model.dtype,
            engine.pool.num_blocks,
            engine_config.block_size,
            engine.max_model_len,
        )
        try:
            async with anyio.create_task_group() as tg:
                engine._tg = tg
                if isinstance(engine.runner, ProcessRunner):
                    await tg.start(run_worker, engine.runner)
                await tg.start(engine.step.run)
                try:
                    yield engine
                finally:
                    engine._shutdown()
        except BaseExceptionGroup as group:
            # Request tasks and the step actor never raise, so a lone exception is the
            # caller's own, from the body of the `async with`: give it back unwrapped.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            engine._closed()

    def _shutdown(self) -> None:
        self._accepting = False
        self._closing = True
        for state in self.registry.live():
            state.cancel("shutdown", by="engine")
        self.step.abort.set()
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
            await self._idle.wait()
        return self.registry.num_live == 0

    # -- the public API ------------------------------------------------------------------

    @asynccontextmanager
    async def request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        parent: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        owner: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Request]:
        """A request that lives as long as the block: iterate it for `Delta`s; leaving
        the block early (break, exception, the caller's scope cancelled) cancels it."""
        state = await self._start(
            prompt, params, priority, parent, request_id, timeout, owner, sampling
        )
        try:
            yield Request(state)
        finally:
            self._cancel_tree(state, "scope", None)
            # Leaving the block means the request is over and its blocks are free (a
            # step in flight drops it at its next checkpoint, so this is short).
            with anyio.CancelScope(shield=True):
                await state.task_done.wait()
                await state.released.wait()

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion:
        """Run a request to its end and return its `Completion`."""
        async with self.request(prompt, params, **kwargs) as request:
            return await request.wait()

    async def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        parent: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        owner: str | None = None,
        **sampling: Any,
    ) -> Job:
        """Start a detached request; it runs until it ends or is cancelled by id."""
        state = await self._start(
            prompt, params, priority, parent, request_id, timeout, owner, sampling
        )
        return Job(state)

    async def submit_samples(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        n: int,
        priority: int = 0,
        request_id: str | None = None,
        timeout: float | None = None,
        owner: str | None = None,
        **sampling: Any,
    ) -> list[Job]:
        """Start `n` samples of one prompt as one family (OpenAI's `n`): sample 0 is the
        parent, the others its children, all started before any can end, so they share
        the prompt's KV blocks and cancelling sample 0 cancels them all. With a seed,
        sample i uses seed + i."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidRequest("n must be a positive integer")
        state = await self._start(
            prompt, params, priority, None, request_id, timeout, owner, sampling, samples=n
        )
        return [Job(state), *(Job(child) for child in state.children)]

    async def cancel(
        self, request_id: str, reason: str = "user", by: str | None = None
    ) -> CancelReport:
        """Cancel a request and its children; returns once its blocks are released."""
        called = time.perf_counter()
        state = self.registry.get(request_id)
        if state is None:
            return CancelReport(id=request_id, found=False, status="unknown")
        status = state.status.public
        children = len(state.live_descendants())
        if not self._cancel_tree(state, reason, by):
            return CancelReport(
                id=request_id,
                found=True,
                status=status,
                cancelled_children=children,
                tokens_generated=len(state.token_ids),
            )
        await state.released.wait()
        assert state.released_at is not None
        return CancelReport(
            id=request_id,
            found=True,
            status=status,
            cancelled_children=children,
            tokens_generated=len(state.token_ids),
            blocks_released=state.blocks_released,
            release_seconds=state.released_at - called,
            waited_for_step=state.waited_for_step,
        )

    def cancel_nowait(self, request_id: str, reason: str = "user", by: str | None = None) -> bool:
        """Cancel without waiting (for `finally` blocks); False if unknown or ended."""
        state = self.registry.get(request_id)
        return state is not None and self._cancel_tree(state, reason, by)

    def get(self, request_id: str) -> RequestInfo | None:
        state = self.registry.get(request_id)
        return state.info() if state is not None else None

    def list_requests(self, owner: str | None = None) -> list[RequestInfo]:
        return [state.info() for state in self.registry.live(owner)]

    def watch(self, request_id: str) -> DeltaStream:
        """The deltas of a request from its start; watching cancels nothing."""
        state = self.registry.get(request_id)
        if state is None:
            raise UnknownRequest(f"no request {request_id!r}")
        return DeltaStream(state)

    def stats(self) -> dict[str, int]:
        pool = self.pool.stats()
        return {
            "kv_blocks_total": pool.total,
            "kv_blocks_free": pool.free,
            "kv_blocks_in_use": pool.in_use,
            "kv_blocks_cached": pool.cached,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "live_requests": self.registry.num_live,
            "finished": self.counts["finished"],
            "cancelled": self.counts["cancelled"],
            "failed": self.counts["failed"],
            "steps": self.step.steps,
            "prompt_tokens_admitted": self.scheduler.prompt_tokens_admitted,
            "prompt_tokens_reused": self.scheduler.prompt_tokens_reused,
            # Request tasks running now, counted by the tasks themselves as they enter
            # and leave (the step actor is not counted): 0 when nothing leaked.
            "tasks": self._request_tasks,
            # The model worker process (0 and 0 with worker="thread").
            "worker_pid": getattr(self.runner, "pid", None) or 0,
            "worker_restarts": getattr(self.runner, "restarts", 0),
            # Ended requests kept for look-up by id, and about the bytes they hold.
            "history": self.registry.num_retained,
            "history_bytes": self.registry.retained_bytes,
        }

    def audit_records(self) -> list[dict[str, Any]]:
        return list(self.audit.records)

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def wait_idle(self) -> None:
        """Wait until no request is live."""
        await self._idle.wait()

    # -- starting a request ---------------------------------------------------------------

    async def _start(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        priority: int,
        parent: str | None,
        request_id: str | None,
        timeout: float | None,
        owner: str | None,
        sampling: dict[str, Any],
        samples: int = 1,
    ) -> RequestState:
        if not self._accepting or self._tg is None:
            raise EngineClosed("the engine is shutting down")
        params = self._sampling_params(params, sampling)
        prompt_ids = await self._encode(prompt)
        # From here to the task's start, nothing awaits: the checks and the admission
        # they guard cannot interleave with another request's.
        if not self._accepting:
            raise EngineClosed("the engine is shutting down")
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_model_len}"
            )
        if params.max_tokens > room:
            params = attrs.evolve(params, max_tokens=room)
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise InvalidRequest("timeout must be a positive number of seconds")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequest("priority must be an integer")
        queued = self.scheduler.num_waiting + self._admitting
        if queued + samples > self.config.max_queued_requests:
            raise EngineOverloaded(
                f"{queued} sequences are already queued; the limit (max_queued_requests) "
                f"is {self.config.max_queued_requests}"
            )
        if request_id is not None and request_id in self.registry:
            raise RequestConflict(f"request id {request_id!r} is already in use")
        parent_state = None
        group = self._tg
        if parent is not None:
            parent_state = self.registry.get(parent)
            if parent_state is None or (owner is not None and parent_state.owner != owner):
                raise UnknownRequest(f"no parent request {parent!r}")
            if parent_state.children_group is None or parent_state.cancel_requested():
                raise RequestConflict(f"parent request {parent!r} has ended")
            group = parent_state.children_group
        self._check_family(parent_state, samples)
        state = self._new_state(
            request_id or new_request_id(self.config.request_id_prefix),
            prompt_ids,
            params,
            priority,
            parent_state,
            owner,
            timeout,
        )
        for index in range(1, samples):
            seed = None if params.seed is None else (params.seed + index) % 2**64
            child = self._new_state(
                new_request_id(self.config.request_id_prefix),
                prompt_ids,
                attrs.evolve(params, seed=seed),
                priority,
                state,
                owner,
                timeout,
            )
            state.pending_children.append(child)
        self._admitting += samples  # until `open_request` queues each sequence
        # Shielded: once the task exists, the caller must get its handle to own it.
        with anyio.CancelScope(shield=True):
            try:
                await group.start(run_request, state, self)
            except RuntimeError as exc:  # the parent's group closed meanwhile
                state.root.family_size -= samples  # counted in _new_state; no task ran
                self._admitting -= samples
                raise RequestConflict(f"parent request {parent!r} has ended") from exc
        return state

    def _check_family(self, parent: RequestState | None, samples: int) -> None:
        """Refuse a request that would make its parent chain or its family too big:
        every level of the chain nests one more cancel scope, and cancelling a family
        reaches each member. Synchronous, and counted in `_new_state` before any await."""
        config = self.config
        depth = parent.depth + 1 if parent is not None else 0
        if depth > config.max_request_depth:
            raise InvalidRequest(
                f"the parent chain is too deep: this request would have {depth} ancestors; "
                f"the limit (max_request_depth) is {config.max_request_depth}"
            )
        if samples > config.max_family_size:
            raise InvalidRequest(
                f"{samples} samples exceed the limit on one family's size "
                f"(max_family_size) of {config.max_family_size}"
            )
        if parent is not None and parent.root.family_size + samples > config.max_family_size:
            raise EngineOverloaded(
                f"the family of {parent.root.id!r} already has {parent.root.family_size} "
                f"live requests; the limit (max_family_size) is {config.max_family_size}"
            )

    def _new_state(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        parent: RequestState | None,
        owner: str | None,
        timeout: float | None,
    ) -> RequestState:
        state = RequestState(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            tokenizer=self.tokenizer,
            priority=priority,
            parent=parent,
            owner=owner,
            timeout=timeout,
            guide=self.guides.guide(params),
        )
        state.root.family_size += 1
        if owner is not None and self.config.isolate_prefix_cache:
            state.seq.cache_salt = hashlib.blake2b(owner.encode(), digest_size=16).digest()
        if not params.greedy:
            state.seq.generator = make_generator(params.seed, self._rng.getrandbits(63))
        return state

    def _sampling_params(
        self, params: SamplingParams | None, sampling: dict[str, Any]
    ) -> SamplingParams:
        unknown = set(sampling) - SamplingParams.fields()
        if unknown:
            raise InvalidRequest(f"unknown sampling field(s): {', '.join(sorted(unknown))}")
        try:
            if params is None:
                # The checkpoint's generation_config.json supplies what the caller left out.
                params = SamplingParams(**{**self.loaded.generation_defaults, **sampling})
            elif sampling:
                params = attrs.evolve(params, **sampling)
            params.check_vocab(self.loaded.config.vocab_size)
            self.guides.check(params)
            return params
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(str(exc)) from None

    async def encode_text(
        self, text: str, *, add_special_tokens: bool = True, what: str = "the prompt"
    ) -> list[int]:
        """Tokenize a client's text: valid Unicode and at most `max_prompt_bytes`
        (checked before tokenizing), and off the event loop when it is big."""
        size = utf8_size(text, what)
        if size > self.max_prompt_bytes:
            raise InvalidRequest(
                f"{what} has {size} bytes; the limit (max_prompt_bytes) is {self.max_prompt_bytes}"
            )
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens)
        if size < self.config.tokenize_in_thread_bytes:
            return encode()
        return await anyio.to_thread.run_sync(encode, limiter=self._tokenize_limiter)

    async def run_off_loop(self, size: int, work: Callable[[], T]) -> T:
        """Run `work` (tokenizing, rendering a chat) in a tokenizer thread when `size`
        (its input's bytes) is at least `tokenize_in_thread_bytes`, else here."""
        if size < self.config.tokenize_in_thread_bytes:
            return work()
        return await anyio.to_thread.run_sync(work, limiter=self._tokenize_limiter)

    async def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            return await self.encode_text(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            if len(prompt) > self.max_model_len:
                raise InvalidRequest(
                    f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len}"
                )
            vocab = self.loaded.config.vocab_size
            for token in prompt:
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                    raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
            return list(prompt)
        raise InvalidRequest("the prompt must be a string or a list of token ids")

    # -- RequestCore: called by request tasks ------------------------------------------------

    def open_request(self, state: RequestState) -> None:
        self._admitting -= 1
        self.registry.add(state)
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        if state.parent is not None:
            state.parent.children.append(state)
        self.scheduler.add(state.seq)
        self.step.wake()
        log.info(
            "request start id=%s prompt_tokens=%d max_tokens=%d priority=%d parent=%s key=%s",
            state.id,
            len(state.prompt_ids),
            state.params.max_tokens,
            state.priority,
            state.parent.id if state.parent else None,
            state.owner,
        )

    def close_request(self, state: RequestState, cancel_reason: str) -> None:
        """The request's cleanup; synchronous, so it always runs to the end."""
        if state.pending_children:  # cancelled before starting them all: they never run
            self._admitting -= len(state.pending_children)
            state.root.family_size -= len(state.pending_children)
            state.pending_children = []
        if state.finish_reason is None:
            if state.cancel_reason is None:
                state.cancel_reason = cancel_reason
                state.cancelled_by = (
                    state.parent.id if cancel_reason == "parent" and state.parent else "engine"
                )
                state.cancel_called_at = time.perf_counter()
                state.cancelled_wall = time.time()
            state.finish_reason = "cancelled"
        seq = state.seq
        state.blocks_released = self.scheduler.remove(seq)
        state.mark_ended(state.finish_reason)
        self.counts[state.status.public] += 1
        if seq.release_pending:
            state.waited_for_step = True
            self.step.note_cancelled(seq)
        else:
            self._release(state)
        self.step.wake()
        log.info(
            "request %s id=%s finish_reason=%s cancel_reason=%s by=%s tokens=%d blocks=%d",
            "cancel" if state.finish_reason == "cancelled" else "finish",
            state.id,
            state.finish_reason,
            state.cancel_reason,
            state.cancelled_by,
            len(state.token_ids),
            state.blocks_released,
        )

    def task_entered(self, state: RequestState) -> None:
        self._request_tasks += 1

    def retire_request(self, state: RequestState) -> None:
        self._request_tasks -= 1
        state.root.family_size -= 1
        self.registry.retire(state)
        if self.registry.num_live == 0:
            self._idle.set()

    def _release(self, state: RequestState) -> None:
        state.mark_released()
        self.audit.write(state.audit_record())
        for listener in self.release_listeners:
            listener(state)
        self.registry.released(state)

    def _after_step(self, started: float, forward_seconds: float, batch: int) -> None:
        for listener in self.step_listeners:
            listener(started, forward_seconds, batch)

    def _cancel_tree(self, state: RequestState, reason: str, by: str | None) -> bool:
        """Cancel `state`, or, if it has ended, its live children; True if it was live.

        Cancelling a live request's scope cancels its children by structure; an ended
        request's task lingers only to host its children, which are cancelled one by
        one. The step actor hears of every sequence so cancelled at once, so one in the
        running step leaves it at the next checkpoint without waiting for the request
        task's cleanup to run first (that cleanup still releases it, in either order).
        """
        if self._cancel_live(state, reason, by):
            return True
        # Iterative, parents before children: the first live request on each path is
        # cancelled with its subtree by structure, and nothing under it is visited.
        stack = [(child, state) for child in reversed(state.children)]
        while stack:
            child, parent = stack.pop()
            if child.task_done.is_set() or self._cancel_live(child, "parent", parent.id):
                continue
            stack.extend((grandchild, child) for grandchild in reversed(child.children))
        return False

    def _cancel_live(self, state: RequestState, reason: str, by: str | None) -> bool:
        """Cancel a live request's scope and tell the step actor of it and every live
        descendant at once; False if it had ended."""
        if not state.cancel(reason, by):
            return False
        for cancelled in (state, *state.live_descendants()):
            self.step.note_cancelled(cancelled.seq)
        return True

    def sequence_of(self, request_id: str) -> Sequence | None:
        state = self.registry.get(request_id)
        return state.seq if state is not None else None


async def run_worker(
    runner: ProcessRunner, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The model worker process as a task of the engine's group: the engine serves at
    once (steps run in-process until a worker is ready); a worker that exits is
    replaced; closing the group stops and reaps the worker."""
    task_status.started()
    try:
        while True:
            try:
                await anyio.to_thread.run_sync(runner.start, abandon_on_cancel=True)
            except WorkerDied as exc:
                log.error("%s; steps run in-process", exc)
                return
            await anyio.to_thread.run_sync(runner.wait_exited, abandon_on_cancel=True)
            runner.restarts += 1
            log.warning("the model worker exited; starting a new one (restart %d)", runner.restarts)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(runner.stop)


__all__ = ["Engine", "RequestStatus"]
