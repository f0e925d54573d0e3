"""What the actors call on a model runner: the `Runner` protocol, and the errors a step
may end with beyond the model's own.

Two runners have it: `ModelRunner` (`execution/runner.py`), which runs each step in a
thread of this process, and `ProcessRunner` (`execution/process_runner.py`), which sends
it to a model worker process. The step actor and the engine's figures use this protocol
only, so they never ask which one they hold; where a runner has no worker (the thread
runner), its worker's side reads as none: no pid, no restart, no cache lost, and no step
sent from the event loop.
"""

from __future__ import annotations

from typing import Protocol

from kvscope.kernels.sampling import Sampled
from kvscope.models.lora import LoraAdapter

from .gaps import GapRecorder
from .step_input import StepControl, StepInput


class WorkerDied(RuntimeError):
    """The model worker process exited while a step needed it."""


class KVCacheLost(RuntimeError):
    """A step was sent after the worker holding the K/V cache went away and before the
    step actor had its running requests recompute (it ran nothing)."""


class Runner(Protocol):
    """One step at a time: its forward and sampling, and the channel into it."""

    #: The gaps between the forward's checkpoints (`execution/gaps.py`).
    gaps: GapRecorder

    @property
    def model_bytes(self) -> int:
        """The memory this process's copy of the model holds (0 once released)."""
        ...

    @property
    def pid(self) -> int | None:
        """The model worker process's pid; None while steps run in this process."""
        ...

    @property
    def restarts(self) -> int:
        """How many times a model worker that exited was replaced."""
        ...

    @property
    def caches_lost(self) -> int:
        """How many workers went away holding the K/V cache's contents."""
        ...

    @property
    def cache_lost(self) -> bool:
        """A worker went away with the K/V cache's contents and no step may run until
        the step actor has had the requests that were in it recompute (`recovered`)."""
        ...

    def recovered(self, losses: int) -> None:
        """(step actor) Every loss up to the `losses`-th is recovered from."""

    def new_control(self) -> StepControl:
        """The control channel the step actor uses for this runner's steps."""
        ...

    def execute(self, step: StepInput, control: StepControl | None = None) -> list[Sampled | None]:
        """(model thread) Run one step; each chunk's output (None where it has none or
        was dropped). Raises `StepAborted`, `KVCacheLost` or `WorkerDied` where the step
        did not finish."""
        ...

    async def execute_on_loop(self, step: StepInput) -> list[Sampled | None] | None:
        """(event loop) `execute` with no thread, where the runner can; None, having
        done nothing, where the step must go through `execute` in a thread."""
        ...

    def add_adapter(self, adapter: LoraAdapter) -> None:
        """(event loop) Hold `adapter`, which the engine read."""

    def forget_adapter(self, name: str) -> None:
        """(event loop) Free the adapter `name`, which no request uses any more."""
