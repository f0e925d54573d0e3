"""The model worker process's side (`worker_main`): load the same model as the engine
(`WorkerSpec`), warm up, take the K/V cache over at the hand-over, then run the steps
it is sent until told to stop or the parent is gone.

Per step the parent sends the frozen `StepInput` and receives the tokens drawn, in the
compact form of `step_wire.py` (each request's parameters sent once, generators as their
states' bytes); a step the worker stops answers `("aborted",)` (a cancelled chunk's
blocks were freed by the loop when it set the flag; the worker's checkpoint only drops
its rows, `shared_control.py`).
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

import attrs
import torch

from kvscope.cache.kv_cache import KVCache
from kvscope.kernels.cpu_decode import cpu_kernel
from kvscope.models.llama import StepAborted
from kvscope.models.loader import LoadedModel, load_model
from kvscope.scheduling import every_thread_as_model_thread, keep_to_cores

from .runner import ModelRunner
from .shared_control import WorkerControl
from .step_wire import StepDecoder, encode_answer
from .warm_up import warm_up_now
from .worker_environment import nice_every_thread

log = logging.getLogger(__name__)


@attrs.frozen
class WorkerSpec:
    """What the worker needs to load the same model as the engine."""

    model: str
    device: str
    dtype: str
    seed: int
    threads: int | None
    checkpoint_gap: float
    nice: int = 0
    #: The step budget the worker warms up for before it is ready (`execution/warm_up.py`).
    warm_up_tokens: int = 0
    #: The cores the worker keeps to (`scheduling.model_cores`); None: every core.
    cores: frozenset[int] | None = None
    #: The LoRA adapters (`EngineConfig.lora_modules`, `max_lora_rank`).
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int | None = None

    def load(self) -> LoadedModel:
        """The model and adapters the engine loaded, loaded again here."""
        return load_model(
            self.model,
            device=torch.device(self.device),
            dtype=self.dtype,
            seed=self.seed,
            lora_modules=self.lora_modules,
            max_lora_rank=self.max_lora_rank,
        )


def worker_main(
    conn: Connection, spec: WorkerSpec, kv_cache: KVCache, flags: torch.Tensor, gaps: Any
) -> None:
    """The worker process: load the model, then run steps until told to stop (None) or
    the parent is gone."""
    import tqdm

    # tqdm's default lock is a multiprocessing semaphore, which a killed worker would
    # leave registered with the resource tracker; a thread lock is all it needs here.
    tqdm.tqdm.set_lock(threading.RLock())
    if spec.nice:
        nice_every_thread(spec.nice)  # before torch starts its threads, which inherit it
    every_thread_as_model_thread()  # the parent's thread that started it asked for short slices
    if spec.cores is not None:
        keep_to_cores(spec.cores)  # before torch starts its threads, which inherit them
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        loaded = spec.load()
        if loaded.model.device.type == "cpu":
            # Its kernels built or loaded first (the engine serves meanwhile), so that
            # the runner measures its linears on the path that serves them: a cost
            # measured on the torch fallback is far too high for good, and keeps the
            # layers cut into pieces and unfused (`kernels/slicing.py`).
            cpu_kernel().wait()
        runner = ModelRunner(
            loaded.model,
            kv_cache,
            checkpoint_gap=spec.checkpoint_gap,
            gaps=gaps,
            adapters=dict(spec.lora_modules),
        )
        warm_up_now(runner, spec.warm_up_tokens)  # the engine serves meanwhile
        control = WorkerControl(flags.numpy())
    except Exception as exc:
        # The parent logs the error's one line; where it came from is told here, on the
        # stderr this process shares with the server (no logging set up: Python's own
        # last-resort handler prints it, traceback included).
        log.exception("the model worker could not load the model")
        conn.send(("failed", f"{exc!r}"))
        return
    conn.send(("loaded",))
    decoder = StepDecoder()
    try:
        # The hand-over: the engine runs no step until this answers (`ProcessRunner.start`).
        runner.kv_cache = kv_cache.taken_over(keep_contents=conn.recv())
        conn.send(("ready", os.getpid()))
        while (message := conn.recv()) is not None:
            step = decoder.decode(message)
            control.reset()
            try:
                tokens = runner.execute(step, control)  # type: ignore[arg-type]
            except StepAborted:
                conn.send(("aborted",))
                continue
            except Exception as exc:
                log.exception("a step failed in the model worker")  # as above
                conn.send(("error", f"{exc!r}"))
                continue
            conn.send(encode_answer(tokens, step))
    except (EOFError, OSError):
        pass  # the parent is gone: nothing to serve
