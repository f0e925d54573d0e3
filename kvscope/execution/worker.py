"""The model worker process: the forward runs in its own process, so the event loop
never shares a GIL with the model (vLLM v1 splits its API server from its engine core
the same way; docs/architecture.md, "The actors and what each owns").

`ProcessRunner` has `ModelRunner`'s interface (`execute(step, control)`,
`new_control()`), called from a thread. Where a worker is ready, the step actor sends
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
* the step's control block is one shared byte for "abort" and one per chunk for
  "cancelled": the loop writes them (`SharedStepControl`) and the worker's checkpoints
  read them (one copy at a time, `WorkerControl`), with no message in between;
* per step the parent sends the frozen `StepInput` and receives the tokens drawn, in
  the compact form of `step_wire.py` (each request's parameters sent once, generators
  as their states' bytes); a step the worker stops answers `("aborted",)` (a cancelled
  chunk's blocks were freed by the loop when it set the flag; the worker's checkpoint
  only drops its rows);
* a guided row's grammar state stays in the parent: the step thread (such a step is
  not sent from the loop) computes the row's token mask before sending the step
  (`MaskOnly` carries it), and tells the grammar the token drawn when the step is done.

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
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import anyio
import attrs
import numpy as np
import torch
import torch.multiprocessing

from kvscope.cache.kv_cache import KVCache
from kvscope.kernels.cpu_decode import cpu_kernel
from kvscope.kernels.sampling import Sampled
from kvscope.models.llama import StepAborted
from kvscope.models.loader import LoadedModel, load_model
from kvscope.models.lora import LoraAdapter
from kvscope.scheduling import every_thread_as_model_thread, keep_to_cores, threads_of_this_process

from .loop_pipe import LoopPipe
from .runner import ModelRunner
from .runner_protocol import KVCacheLost, WorkerDied
from .step_input import ChunkInput, StepControl, StepInput
from .step_wire import StepDecoder, StepEncoder, decode_answer, encode_answer
from .warm_up import warm_up_now

log = logging.getLogger(__name__)

#: Seconds to wait for the step in flight before a stopping worker is killed.
STOP_TIMEOUT = 5.0

#: Said when a worker exits before it is ready: the usual cause in a script of one's own.
MAIN_GUARD_HINT = (
    "a script that opens the engine with worker='process' must do it under"
    " `if __name__ == '__main__':`, as the worker process imports the script again"
)

#: How much of the device's free memory a second copy of the model may take while the
#: worker loads it beside the engine's; past that, the engine's copy goes first.
SECOND_COPY_SHARE = 0.8


#: glibc's malloc tunables the worker starts with, by name.
#:
#: `hugetlb=1`: its large allocations (the weights, their prepacked copies, the activations)
#: ask for transparent huge pages, so a forward's reads miss the TLB less. In-process on the
#: 2-core machine, 2 threads, three alternating runs of 200 steps each: a decode step of 32
#: rows 15.3-15.4 ms (mean) against 15.9-18.8, of one row 7.2-7.7 against 7.6-8.9
#: (docs/benchmarks/README.md, "Measured settings": the worker's heap on huge pages).
#:
#: `mmap_threshold` and `trim_threshold`: a step's activations (up to 32 MiB each) come from
#: the heap, and the heap keeps what the biggest step freed instead of handing it back to
#: the kernel and faulting it in again (zeroing each huge page) the next step: the worker
#: holds its busiest step's memory, as a caching allocator would. A step of 8 prompts of 256
#: tokens and 8 decode rows, in-process, 2 threads, 20 steps a run: 0.2-0.4 page faults a
#: step against 31-62, a mean of 95-111 ms in five runs against 114-127 with `hugetlb`
#: alone, in four (docs/benchmarks/README.md, "Measured settings": the worker's heap keeps
#: its pages). Served, the worker had settled to few faults after its first level anyway (81
#: in a level, against 0-6), and 32 streams showed no difference in three alternating pairs;
#: the tunables take the first level's 1,400 faults and the in-process variance away.
#:
#: A glibc before 2.35 ignores `hugetlb`; a kernel with transparent huge pages off
#: ignores the advice.
MALLOC_TUNABLES = {
    "glibc.malloc.hugetlb": "1",
    "glibc.malloc.mmap_threshold": str(32 << 20),  # glibc's largest
    "glibc.malloc.trim_threshold": str(1 << 30),
}


#: How long (in spins of libgomp, torch's OpenMP runtime) a model thread that waits, at
#: a barrier or for the next step, spins before it sleeps; set in the worker's
#: environment unless the user set `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`. libgomp's
#: default, 300,000, is ~4 ms here, less than a served worker's wait between one
#: request's last step and the next one's first (~5 ms at one stream) or between
#: steps while the loop takes in a burst of requests; the helper then sleeps, and the
#: next forward waits for it to wake. 3,000,000 is ~40 ms, spent once each time the
#: worker goes idle (measured: 40 ms of CPU in the idle second after a parallel op,
#: against 10). Served on the 2-core machine, 2 threads, beside the real-time loop,
#: alternating: 32 streams, four pairs of two levels, 1,358-1,531 tok/s against
#: 1,113-1,527, TTFT p50 201-258 ms against 209-284; one stream, four pairs, TTFT p50
#: 26.2-27.4 ms against 27.3-36.2, 151-162 tok/s against 152-166 (docs/benchmarks/
#: README.md, "Measured settings": OpenMP threads spin longer). Intel's OpenMP runtime,
#: where torch uses it, ignores it (its own `KMP_BLOCKTIME` is 200 ms).
GOMP_SPINCOUNT = 3_000_000


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


class SharedFlag:
    """A `threading.Event`-like flag in one byte of shared memory."""

    def __init__(self, flags: np.ndarray, index: int) -> None:
        self._flags = flags
        self._index = index

    def set(self) -> None:
        self._flags[self._index] = 1

    def clear(self) -> None:
        self._flags[self._index] = 0

    def is_set(self) -> bool:
        return bool(self._flags[self._index])


class SharedStepControl(StepControl):
    """(parent) A `StepControl` whose abort flag and cancelled chunks are also written
    to the shared control block the worker reads."""

    def __init__(self, flags: np.ndarray) -> None:
        super().__init__()
        self._flags = flags
        self.abort = SharedFlag(flags, 0)  # type: ignore[assignment]

    def reset(self) -> None:
        super().reset()
        self._flags[:] = 0

    def cancel(self, chunk: int) -> None:
        super().cancel(chunk)
        self._flags[chunk + 1] = 1


@attrs.frozen
class MaskOnly:
    """(worker) A guided row's token mask, computed by the parent's grammar; the parent
    tells its grammar the token drawn, so accepting here does nothing."""

    mask: torch.Tensor | None

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        return self.mask

    def accept(self, token: int) -> None:
        pass


def _guide_to_mask(chunk: ChunkInput) -> Any:
    """The grammar whose mask this chunk's row needs this step, if any (it samples)."""
    guide = chunk.state.guide if chunk.state is not None else None
    return guide if chunk.sample else None


def _masks_for_worker(step: StepInput, vocab_size: int) -> tuple[StepInput, list[tuple[int, Any]]]:
    """`step` with each guided row's grammar replaced by its mask for this step, and the
    (chunk, grammar) pairs to tell the tokens drawn."""
    guided = []
    chunks = list(step.chunks)
    for index, chunk in enumerate(chunks):
        guide = _guide_to_mask(chunk)
        if guide is None:
            continue
        guided.append((index, guide))
        assert chunk.state is not None  # it has a guide
        # MaskOnly stands in for the grammar with what the forward uses (allowed, accept)
        mask = MaskOnly(guide.allowed(vocab_size))
        state = attrs.evolve(chunk.state, guide=mask)  # type: ignore[arg-type]
        chunks[index] = attrs.evolve(chunk, state=state)
    return (attrs.evolve(step, chunks=chunks) if guided else step), guided


class WorkerControl:
    """(worker) What the runner's checkpoints read: the shared control block."""

    def __init__(self, flags: np.ndarray) -> None:
        self.abort = SharedFlag(flags, 0)
        self._chunks = flags[1:]
        self._taken: set[int] = set()

    def reset(self) -> None:
        self._taken.clear()

    def take_cancelled(self) -> set[int]:
        # The loop writes these bytes while this reads them: read one copy, since numpy's
        # nonzero counts twice and raises if the count changed in between.
        snapshot = self._chunks.copy()
        if not snapshot.any():
            return set()
        marked = set(np.flatnonzero(snapshot).tolist()) - self._taken
        self._taken |= marked
        return marked

    def dropped(self, chunks: list[int]) -> None:
        """The parent freed their blocks when it set the flags; nothing to tell it."""


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
        _nice_every_thread(spec.nice)  # before torch starts its threads, which inherit it
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


@contextmanager
def worker_environment() -> Iterator[None]:
    """The environment a worker process is spawned with: this process's, plus
    `worker_variables`. multiprocessing's spawn takes no environment of its own, so this
    process's is changed for the spawn's duration and restored after it; another thread
    that reads those variables meanwhile sees the worker's values (glibc and OpenMP
    read them only at a program's start, so no running code changes behaviour)."""
    changes = worker_variables(os.environ)
    before = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def worker_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a worker's environment sets beyond `environ`: `GLIBC_TUNABLES` with
    each of `MALLOC_TUNABLES` the user's does not set already (theirs wins), and
    `GOMP_SPINCOUNT` unless the user set it or `OMP_WAIT_POLICY`."""
    users = [entry for entry in environ.get("GLIBC_TUNABLES", "").split(":") if entry]
    named = {entry.split("=", 1)[0] for entry in users}
    ours = [f"{name}={value}" for name, value in MALLOC_TUNABLES.items() if name not in named]
    variables = {"GLIBC_TUNABLES": ":".join(users + ours)}
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        variables["GOMP_SPINCOUNT"] = str(GOMP_SPINCOUNT)
    return variables


def _nice_every_thread(increment: int) -> None:
    """Lower this process's priority by `increment`: Linux keeps a nice value per thread,
    so the threads already running (one starts before `worker_main`) are set one by one;
    the ones started later inherit it from their creator."""
    value = os.nice(increment)
    for thread in threads_of_this_process():
        try:
            os.setpriority(os.PRIO_PROCESS, thread, value)
        except ProcessLookupError:
            pass  # it ended since the listing


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
                sent, guided = _masks_for_worker(step, self.vocab_size)
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
        if any(_guide_to_mask(chunk) is not None for chunk in step.chunks):
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
        try:
            message = parent.recv()
        except EOFError:
            message = ("failed", f"it exited while loading the model ({MAIN_GUARD_HINT})")
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
        """(blocking) Let the step in flight end, then stop the worker and reap it. A
        step still in flight after `STOP_TIMEOUT` (a hung worker) has its worker killed:
        the step then reads the end of the pipe, fails with `WorkerDied` and drops the
        worker itself. Its pipe is not closed from here, as the step is waiting on it
        (a socket closed under the event loop's wait never wakes it)."""
        self._stopping = True
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


def room_for_a_second_copy(model_bytes: int, free_bytes: int | None) -> bool:
    """Whether the worker may load its copy of the model while the engine holds its own
    (the engine serves meanwhile); unknown free memory counts as room."""
    return free_bytes is None or model_bytes <= SECOND_COPY_SHARE * free_bytes


def free_memory(device: torch.device) -> int | None:
    """The bytes a new allocation can take on `device` (Linux's MemAvailable on the CPU,
    the driver's free memory on CUDA); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reap(process: Any, timeout: float) -> int | None:
    """Wait up to `timeout` s for `process` to exit, kill it if it has not; its exit code."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
    return process.exitcode
