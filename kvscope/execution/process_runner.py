"""The model worker process: the forward runs in its own process, so the event loop
never shares a GIL with the model (vLLM v1 splits its API server from its engine core
the same way; docs/architecture.md, "The actors and what each owns").

`ProcessRunner` is a `Runner` (`runner_protocol.py`), as `ModelRunner` is: `execute`
is called from a thread. Where a worker is ready, the step actor sends
the step from the event loop instead (`execute_on_loop`, over `LoopPipe`): no thread
to wake and no GIL to pass each way.

What is shared, and how:

* the K/V cache is allocated by the engine in shared memory, where its own copy of the
  model runs the steps until a worker is ready; at the hand-over (no step runs
  meanwhile) the worker takes it over as memory of its own, on huge pages
  (`KVCache.taken_over`), and the shared pages are given back. A worker that exits
  takes the cache's contents with it: the step actor then has every running request
  recompute its tokens and the prefix cache forget its blocks (`cache_lost`), and a
  step sent before that fails with `KVCacheLost`, having run nothing;
* the step's control block is in shared memory, written by the loop and read by the
  worker's checkpoints with no message in between (`shared_control.py`);
* per step the parent sends the frozen `StepInput` and receives the tokens drawn, in
  the compact form of `step_wire.py` (the worker's side: `worker_child.py`);
* a guided row's grammar state stays in the parent, which sends the row's token mask
  (`guided_masks.py`).

Until the first worker is ready the engine's own copy of the model runs the steps, so
it serves at once; then that copy releases its weights (the model is not held twice).
If the worker dies, the step in flight fails with `WorkerDied` (its requests end with
an error; their tasks release their blocks), the other running requests recompute their
tokens (the cache went with the worker), and a new worker is started (`restarts`
counts them); steps wait for it. Only if a worker fails to start does the engine load
the model again and run the steps itself.
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import anyio
import torch
import torch.multiprocessing

from kvscope.kernels.sampling import Sampled
from kvscope.models.llama import StepAborted
from kvscope.models.lora import LoraAdapter

from .guided_masks import guide_to_mask, masks_for_worker
from .loop_pipe import LoopPipe
from .runner import ModelRunner
from .runner_protocol import KVCacheLost, WorkerDied
from .shared_control import SharedStepControl
from .step_input import StepControl, StepInput
from .step_wire import StepEncoder, decode_answer
from .worker_child import WorkerSpec, worker_main
from .worker_environment import worker_environment
from .worker_memory import free_memory, room_for_a_second_copy

log = logging.getLogger(__name__)

#: Seconds to wait for the step in flight before a stopping worker is killed.
STOP_TIMEOUT = 5.0

#: Said when a worker exits before it is ready: the usual cause in a script of one's own.
MAIN_GUARD_HINT = (
    "a script that opens the engine with worker='process' must do it under"
    " `if __name__ == '__main__':`, as the worker process imports the script again"
)


class ProcessRunner:
    """(parent) Runs each step in the model worker process; see the module docstring.

    Until the first worker is ready steps run on `local`, an in-thread `ModelRunner`
    over the same shared K/V cache, so the engine serves at once and never waits for a
    worker to boot; once one is ready, `local`'s model releases its weights, and a
    step that finds no worker (one died, a new one is starting) waits for the next.
    The step actor sends a step from the event loop where it can (`execute_on_loop`),
    else from a thread (`execute`).
    `actors/parts.py: run_worker` (in the engine's task group) starts workers and
    notices when one exits.
    """

    def __init__(self, spec: WorkerSpec, local: ModelRunner, max_chunks: int) -> None:
        self.spec = spec
        self.local = local
        self.kv_cache = local.kv_cache
        self.kv_cache.share_memory()
        local.gaps.share_memory()
        self.gaps = local.gaps  # the worker counts into the same histogram
        self.vocab_size = local.model.config.vocab_size
        self._flags = torch.zeros(max_chunks + 1, dtype=torch.uint8).share_memory_()
        self._context = torch.multiprocessing.get_context("spawn")
        self._process: Any = None  # the ready worker, or None
        self._conn: Connection | None = None
        self._pipe: LoopPipe | None = None  # the same, for the event loop
        self._encoder: StepEncoder | None = None  # what that worker was sent so far
        self._lock = threading.Lock()  # guards the four above; held for a whole step
        self._changed = threading.Condition(self._lock)  # a worker is ready, or none will be
        self._stopping = False
        self._starting: Any = None  # a worker not ready yet: `stop` kills it (it holds nothing)
        self._gave_up = False  # a worker failed to start: no other is coming
        self._local_ran = False  # the engine's copy ran steps: the cache holds their K/V
        self.restarts = 0
        #: Workers that went away holding the K/V cache, and how many of those losses
        #: the step actor has recovered from (`recovered`).
        self.caches_lost = 0
        self._caches_recovered = 0

    @property
    def model_bytes(self) -> int:
        """The memory the engine's own copy of the model holds (0 once released)."""
        return self.local.model_bytes

    @property
    def pid(self) -> int | None:
        """The ready worker's pid (None while steps run in this process)."""
        process = self._process
        return process.pid if process is not None and self._conn is not None else None

    def new_control(self) -> StepControl:
        return SharedStepControl(self._flags.numpy())

    def add_adapter(self, adapter: LoraAdapter) -> None:
        """(event loop) `ModelRunner.add_adapter` for the engine's copy; the worker
        reads its own when the next step carries the table's change."""
        self.local.add_adapter(adapter)

    def forget_adapter(self, name: str) -> None:
        """(event loop) Free the engine's copy of the adapter `name`; the worker frees
        its own when the next step carries the table's change (`StepEncoder`)."""
        self.local.forget_adapter(name)

    @property
    def cache_lost(self) -> bool:
        """A worker went away with the K/V cache's contents, and no step may run until
        the step actor has had the requests that were in it recompute (`recovered`)."""
        return self.caches_lost != self._caches_recovered

    def recovered(self, losses: int) -> None:
        """(step actor) Every loss up to the `losses`-th is recovered from."""
        self._caches_recovered = losses

    def execute(self, step: StepInput, control: StepControl | None = None) -> list[Sampled | None]:
        with self._lock:
            if self.cache_lost:
                raise KVCacheLost("the model worker holding the K/V cache went away")
            if self._conn is None and self._wait_for_worker(control) is None:
                self._local_ran = True
                return self.local.execute(step, control)
            assert self._conn is not None
            try:
                sent, guided = masks_for_worker(step, self.vocab_size)
                assert self._encoder is not None  # set with the connection
                self._conn.send(self._encoder.encode(sent))
                sampled = decode_answer(step, self._conn.recv())
            except (EOFError, OSError) as exc:
                raise self._died() from exc
            for index, guide in guided:
                if (row := sampled[index]) is not None and row.token is not None:
                    guide.accept(row.token)
            return sampled

    async def execute_on_loop(self, step: StepInput) -> list[Sampled | None] | None:
        """(event loop) `execute` with no thread: the step is sent to the ready worker
        and its answer read by the event loop (`LoopPipe`). None, having done nothing,
        where the step must go through `execute` in a thread: no worker is ready (the
        step may have to wait for one), another thread holds the runner (a worker
        starting or stopping), or a row is guided (its grammar's mask is work to keep
        off the loop)."""
        if any(guide_to_mask(chunk) is not None for chunk in step.chunks):
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._pipe is None or self.cache_lost:
                return None
            # Shielded: once sent, the answer must be read, as `execute` in a thread would.
            with anyio.CancelScope(shield=True):
                try:
                    assert self._encoder is not None  # set with the pipe
                    await self._pipe.send(self._encoder.encode(step))
                    message = await self._pipe.receive()
                except (EOFError, OSError) as exc:
                    died = await anyio.to_thread.run_sync(self._died)
                    raise died from exc
            return decode_answer(step, message)
        finally:
            self._lock.release()

    def _died(self) -> WorkerDied:
        """(lock held) The worker's pipe broke mid-step: drop and reap it."""
        pid, code = self._process.pid, self._drop_worker(1.0)
        return WorkerDied(f"the model worker (pid {pid}) died mid-step (exit code {code})")

    def _wait_for_worker(self, control: StepControl | None) -> Connection | None:
        """(lock held) The ready worker's pipe, waiting for one that is starting if the
        local copy has released its weights; None where the step runs locally (the
        model loaded again if no worker is coming)."""
        while self._conn is None and self.local.model.released:
            if self._stopping:
                raise WorkerDied("the model worker was stopped")
            if self._gave_up:
                log.warning("no model worker: loading the model again to run steps here")
                loaded = self.spec.load()
                self.local = ModelRunner(
                    loaded.model,
                    self.kv_cache,
                    checkpoint_gap=self.spec.checkpoint_gap,
                    gaps=self.gaps,
                    adapters=self.local.adapters,  # the engine's table
                )
                return None
            if control is not None and control.abort.is_set():
                raise StepAborted  # everyone in the step left while it waited
            self._changed.wait(0.02)
        return self._conn

    def start(self) -> None:
        """(blocking) Start a worker and, once its model is loaded, send it the steps."""
        started = time.perf_counter()
        needed, free = self.local.model_bytes, free_memory(torch.device(self.spec.device))
        if needed and not room_for_a_second_copy(needed, free):
            with self._lock:
                self.local.release_model()
            log.warning(
                "the model (%.0f MiB) cannot be held twice (%.0f MiB free): the engine's own"
                " copy is released now, and steps wait for the model worker process",
                needed / 2**20,
                (free or 0) / 2**20,
            )
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=worker_main,
            args=(child, self.spec, self.kv_cache, self._flags, self.gaps),
            name="kvscope-model-worker",
            daemon=True,
        )
        try:
            with worker_environment():
                process.start()
        except OSError as exc:  # the system refused (no memory, too many processes)
            parent.close()
            with self._lock:
                self._gave_up = True
                self._changed.notify_all()
            raise WorkerDied(f"the model worker failed to start: cannot spawn it: {exc!r}") from exc
        finally:
            child.close()
        self._starting = process
        if self._stopping:  # stopped while it spawned
            process.kill()
        try:
            message = parent.recv()
        except EOFError:
            message = ("failed", f"it exited while loading the model ({MAIN_GUARD_HINT})")
        self._starting = None
        with self._lock:
            self._changed.notify_all()
            if message[0] == "loaded" and not self._stopping:
                message = _hand_over(parent, keep_contents=self._local_ran)
                self._local_ran = False
            if message[0] != "ready" or self._stopping:
                parent.close()
                _reap(process, 0.0 if self._stopping else 1.0)
                if self._stopping:
                    return
                self._gave_up = True
                raise WorkerDied(f"the model worker failed to start: {message[1]}")
            released = self.local.model_bytes
            self.local.release_model()  # before /stats can show the worker as ready
            self._process, self._conn, self._pipe = process, parent, LoopPipe(parent)
            self._encoder = StepEncoder(self.local.adapters, dict(self.spec.lora_modules))
        freed = (
            f"; the engine's copy of the model freed {released / 2**20:.0f} MiB" if released else ""
        )
        elapsed = time.perf_counter() - started
        cores = self.spec.cores
        kept = "" if cores is None else f" on cores {','.join(map(str, sorted(cores)))}"
        log.info("model worker pid %d ready%s in %.1f s%s", process.pid, kept, elapsed, freed)

    def wait_exited(self) -> None:
        """(blocking) Return when the current worker has exited."""
        process = self._process
        if process is not None:
            process.join()
        with self._lock:
            if self._process is process and process is not None:
                self._drop_worker(0.0)

    def stop(self) -> None:
        """(blocking) Kill and reap a worker still starting; let the step in flight end,
        then stop the ready worker and reap it. A step still in flight after
        `STOP_TIMEOUT` (a hung worker) has its worker killed: the step then fails with
        `WorkerDied` and drops it. Its pipe is not closed from here: a socket closed
        under the event loop's wait never wakes it."""
        self._stopping = True
        if (starting := self._starting) is not None:
            _reap(starting, 0.0)  # killed; its start thread then reads the pipe's end
        if not self._lock.acquire(timeout=STOP_TIMEOUT):
            process = self._process  # the step holding the lock keeps it set
            if process is not None:
                process.kill()
            return
        try:
            self._changed.notify_all()
            if self._conn is not None:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
            self._drop_worker(STOP_TIMEOUT)
        finally:
            self._lock.release()

    def _drop_worker(self, timeout: float) -> int | None:
        """Forget the worker and the K/V cache's contents it held, and reap it; its
        exit code."""
        process, conn, pipe = self._process, self._conn, self._pipe
        if conn is not None:
            self.caches_lost += 1
        self._process = self._conn = self._pipe = self._encoder = None
        if pipe is not None:
            pipe.close()
        if conn is not None:
            conn.close()
        return _reap(process, timeout) if process is not None else None


def _hand_over(conn: Connection, *, keep_contents: bool) -> tuple[Any, ...]:
    """(lock held: no step runs) Have a loaded worker take the K/V cache over, copying
    its contents where the engine's own copy of the model ran steps on it; the
    worker's answer, `("ready", pid)` once it has."""
    try:
        conn.send(keep_contents)
        return conn.recv()  # type: ignore[no-any-return]
    except (EOFError, OSError):
        return ("failed", "it exited while taking the K/V cache over")


def _reap(process: Any, timeout: float) -> int | None:
    """Wait up to `timeout` s for `process` to exit, kill it if it has not; its exit code."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
    return process.exitcode
