"""What an engine is built of: the model (loaded off the event loop), and the block
pool, the scheduler, the K/V cache and the model runner sized from its config, with the
model worker process to start or the warm-up to run while idle; and `run_worker`, the
model worker process's task in the engine's group."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import anyio
import attrs
import torch
from anyio.abc import TaskStatus

from kvscope.cache.block_pool import BlockPool
from kvscope.cache.kv_cache import KVCache
from kvscope.config import EngineConfig
from kvscope.execution.process_runner import ProcessRunner
from kvscope.execution.runner import ModelRunner
from kvscope.execution.runner_protocol import Runner, WorkerDied
from kvscope.execution.warm_up import WarmUp
from kvscope.execution.worker_child import WorkerSpec
from kvscope.kernels.attention import block_major_cache
from kvscope.kernels.device import select_device
from kvscope.models.catalog import resolve_model
from kvscope.models.loader import LoadedModel, load_model, served_as
from kvscope.models.lora import check_adapter_name
from kvscope.scheduling import allowed_cores, model_cores

from .scheduler import Scheduler

log = logging.getLogger("kvscope.requests")


@attrs.frozen
class Parts:
    loaded: LoadedModel
    config: EngineConfig
    device: torch.device
    pool: BlockPool
    scheduler: Scheduler
    kv_cache: KVCache
    runner: Runner
    #: The LoRA adapters' table (name -> directory), shared with the runner, which the
    #: engine changes (`Engine.load_adapter`).
    adapters: dict[str, str]
    #: The model worker process's runner, for the engine to start (`run_worker`); None
    #: with the thread worker.
    worker: ProcessRunner | None
    #: The thread worker's warm-up, run by the step actor while idle; None with a model
    #: worker process, which warms up before it is ready.
    warm_up: WarmUp | None


async def load_parts(model: str, device: str, dtype: str, config: dict[str, Any]) -> Parts:
    """Load `model` and build the rest around it (`Engine.open`'s arguments). A short
    name (`models/catalog.py`) is served under that name from its file."""
    engine_config = EngineConfig.from_kwargs(**config)
    short_name = model
    model = await anyio.to_thread.run_sync(resolve_model, short_name)
    if model != short_name and engine_config.served_model_name is None:
        engine_config = attrs.evolve(engine_config, served_model_name=short_name)
    torch_device = select_device(device)
    if engine_config.model_threads:
        torch.set_num_threads(engine_config.model_threads)
    loaded = await anyio.to_thread.run_sync(
        lambda: load_model(
            model,
            device=torch_device,
            dtype=dtype,
            seed=engine_config.seed,
            lora_modules=engine_config.lora_modules,
            max_lora_rank=engine_config.max_lora_rank,
        )
    )
    loaded = served_as(
        loaded,
        name=engine_config.served_model_name,
        chat_template=engine_config.chat_template,
        generation_config=engine_config.generation_config,
        override_generation_config=engine_config.override_generation_config,
    )
    for name, _ in engine_config.lora_modules:
        check_adapter_name(name, loaded.name)
    worker = None
    if engine_config.worker == "process":
        threads = engine_config.model_threads
        worker = WorkerSpec(
            model,
            str(torch_device),
            dtype,
            engine_config.seed,
            threads,
            engine_config.checkpoint_gap,
            engine_config.worker_nice,
            engine_config.max_num_batched_tokens,
            # On a CPU the forward's threads keep to cores of their own (`scheduling.py`).
            model_cores(engine_config.worker_cores, threads, allowed_cores(), os.environ)
            if torch_device.type == "cpu"
            else None,
            engine_config.lora_modules,
            engine_config.max_lora_rank,
        )
    return build_parts(loaded, engine_config, torch_device, worker)


def build_parts(
    loaded: LoadedModel, config: EngineConfig, device: torch.device, worker: WorkerSpec | None
) -> Parts:
    model_config = loaded.config
    num_blocks = config.num_kv_blocks or math.ceil(config.kv_cache_tokens / config.block_size)
    pool = BlockPool(num_blocks, enable_prefix_caching=config.enable_prefix_caching)
    scheduler = Scheduler(
        pool,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        watermark=config.watermark,
        max_step_seconds=config.max_step_seconds,
    )
    kv_cache = KVCache(
        num_layers=model_config.num_layers,
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        dtype=loaded.model.dtype,
        device=device,
        block_major=block_major_cache(device),
    )
    # The forward runs in a worker thread, or, given a spec, in a model worker process.
    adapters = dict(config.lora_modules)
    local = ModelRunner(
        loaded.model, kv_cache, checkpoint_gap=config.checkpoint_gap, adapters=adapters
    )
    process = None if worker is None else ProcessRunner(worker, local, config.max_num_seqs)
    runner: Runner = local if process is None else process
    # A model worker process warms up before it is ready; the thread worker, while idle.
    warm_up = WarmUp(local, config.max_num_batched_tokens) if process is None else None
    return Parts(
        loaded, config, device, pool, scheduler, kv_cache, runner, adapters, process, warm_up
    )


async def run_worker(
    runner: ProcessRunner, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The model worker process as a task of the engine's group: the engine serves at
    once (steps run in-process until a worker is ready); a worker that exits is
    replaced; one that fails to start leaves the steps to this process for good;
    closing the group stops and reaps the worker."""
    task_status.started()
    try:
        while True:
            try:
                await anyio.to_thread.run_sync(runner.start, abandon_on_cancel=True)
            except WorkerDied as exc:
                log.error("%s; steps run in-process", exc)
                await anyio.sleep_forever()  # until the engine closes
            await anyio.to_thread.run_sync(runner.wait_exited, abandon_on_cancel=True)
            runner.restarts += 1
            log.warning("the model worker exited; starting a new one (restart %d)", runner.restarts)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(runner.stop)
