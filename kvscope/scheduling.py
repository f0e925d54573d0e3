"""How the server's threads ask Linux's scheduler for the CPU: the event loop's thread
asks for short time slices, the model's threads run as a batch job, and a model worker
with fewer threads than cores keeps to cores of its own.

Where the model fills every core, a woken event loop waits for a model thread to give up
its CPU. Linux's EEVDF scheduler (6.6 on) runs the eligible thread whose virtual
deadline, one slice past where it stands, comes first; since 6.12 a thread may ask for
its own slice (`sched_setattr` with SCHED_OTHER and `sched_runtime`, no privilege
needed). The loop asks for the shortest, `LOOP_SLICE`, so when it wakes its deadline is
earlier than a model thread's and it runs sooner. `bench cancel` on the 2-core machine,
two runs each, 2 model threads (thread / process worker): the loop lag p50 0.26-0.29 /
0.36 ms against 0.44-0.46 / 0.34-0.36, its p99 4.4-4.5 / 4.2-4.5 against 4.7-4.9 /
4.5-4.7 (docs/benchmarks/README.md, "Measured settings": the event loop asks for
short time slices).

The model's threads run under SCHED_BATCH (`as_model_thread`), with the default slice:
the kernel never lets a batch thread's wake-up preempt the thread that is running (the
tick shares the CPU out, by the same weights), so the model worker, woken by the step
the loop has just sent, no longer takes the CPU from the loop in the middle of its
pass. Measured with the step sent from the loop (process worker, reference model, 2
threads), the send's p90 was 2.6 ms of wall time for 0.02 ms at p50: the loop was
descheduled at the send. Served tokens/s, the same server with and without, three
interleaved pairs: 90-102 against 84-91 at one stream, 337-396 against 318-377 at 32
(docs/benchmarks/README.md, "Measured settings": the model's threads run as a batch
job). A thread starts with its creator's policy and slice, so a thread that runs the
forward takes the batch policy before its first step and before it starts torch's
threads, which inherit it; the model worker process sets it on every thread it has when
it starts (`every_thread_as_model_thread`).

Short slices still leave the loop to the tick once it has run past its slice: a
model thread the tick picks keeps the CPU until the next tick (4 ms at 250 Hz), and
with the model on every core a loop pass cut that way took 4.2-4.7 ms (30-55 passes in
a `bench cancel` round, process worker, 2 threads). So where the OS allows it
(CAP_SYS_NICE, or an RLIMIT_RTPRIO of at least the priority) the loop's thread also
asks for the real-time policy SCHED_FIFO at `LOOP_PRIORITY`, the lowest
(`ask_for_realtime`): no thread of the default policies then takes its CPU, and it
runs the moment it wakes. It mostly waits, so it takes little; the kernel keeps 5 % of
each second for the other policies whatever it does (`sched_rt_runtime_us`). Its
children, threads and processes, start under the default policy
(SCHED_RESET_ON_FORK). A loop kept busy (a model so fast that the loop's own work is
the bottleneck, a flood of requests) would take its core from every other thread of
the machine, the model's included, so `RealtimeLoop` holds the policy only while the
loop uses at most `REALTIME_MOST_BUSY` of its core, and takes it back once the loop is
under `REALTIME_RESUME_BUSY` again. The same `bench cancel` round with and without: 1-3
passes over 3 ms against 28-42, a loop-lag p99 of 0.9-1.3 against 4.3-6.8 ms
(docs/benchmarks/README.md, "Measured settings": the loop under SCHED_FIFO).

A model worker process whose threads are fewer than the cores it may use keeps to the
last of them (`model_cores`, `keep_to_cores`; `worker_cores` lists others, or "all"
keeps every core, as Ray Serve replicas do), leaving the first to the event loop,
hypercorn and whatever serves beside them, as vLLM's CPU build keeps a core for its API
server (`VLLM_CPU_NUM_OF_RESERVED_CPU`). `bench cancel`, process worker, 1 thread on 2
cores, four alternating pairs: the DELETE's answer went from written to read in
0.56-0.66 ms at p50 in three runs of four (1.40 in the fourth) against 1.36-1.87, the
loop lag's p99 1.26-1.67 against 1.76-2.56 ms (docs/benchmarks/README.md, "Measured
settings": the worker keeps to the last cores; keeping the loop's thread off the model's
core as well made it worse). Where the user binds OpenMP's threads themselves
(`OPENMP_BINDINGS`), the worker keeps the cores it was given.

Elsewhere (not Linux, a kernel before 6.12 for the slices, a seccomp filter that
refuses the call, no privilege for the real-time policy) nothing changes, and
`ask_for_short_slices` and `ask_for_realtime` say why.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import struct
import threading
import time
from collections.abc import Mapping

import anyio

log = logging.getLogger("kvscope.web")

#: The slice the event loop's thread asks for, in seconds (the kernel's shortest).
LOOP_SLICE = 0.0001
#: The SCHED_FIFO priority the event loop's thread asks for (the lowest real-time one:
#: above every thread of the default policies, below the kernel's own real-time ones).
LOOP_PRIORITY = 1
#: The share of its core the event loop's thread may use, over `REALTIME_WINDOW`, and
#: keep the real-time policy (at 32 streams of the reference model it used ~0.17)...
REALTIME_MOST_BUSY = 0.5
#: ...and the share it must fall under, over a window, to take the policy back.
REALTIME_RESUME_BUSY = 0.25
#: Seconds over which the loop's share of its core is measured.
REALTIME_WINDOW = 1.0

#: Variables with which a user binds OpenMP's threads to cores: where one is set, the
#: model worker keeps every core it was given.
OPENMP_BINDINGS = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")

_SCHED_OTHER = 0
_SCHED_BATCH = 3
#: `struct sched_attr` up to `sched_period`: size, policy, flags, nice, priority,
#: runtime, deadline, period.
_ATTR = struct.Struct("IIQiIQQQ")
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}  # sched_setattr, sched_getattr
_defaults = threading.local()


def _syscalls() -> tuple[int, int] | None:
    if platform.system() != "Linux":
        return None
    return _SYSCALLS.get(platform.machine())


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def current_slice(tid: int = 0) -> float | None:
    """Thread `tid`'s slice in seconds (0: the calling thread); None where the kernel
    does not say (not Linux, or a kernel before 6.12, which reports 0)."""
    calls = _syscalls()
    if calls is None:
        return None
    buffer = ctypes.create_string_buffer(_ATTR.size)
    if _libc().syscall(calls[1], tid, buffer, _ATTR.size, 0) != 0:
        return None
    runtime = _ATTR.unpack(buffer.raw)[5]
    return runtime / 1e9 if runtime else None


def set_slice(seconds: float | None, tid: int = 0) -> str | None:
    """Ask for a slice of `seconds` (None: the default) for thread `tid` (0: the calling
    thread), under SCHED_OTHER, keeping its nice value; None if the kernel holds it, else
    why not."""
    if _syscalls() is None:
        return f"no sched_setattr on {platform.system()} {platform.machine()}"
    runtime = 0 if seconds is None else round(seconds * 1e9)
    error = _set_attr(tid, _SCHED_OTHER, runtime)
    if error:
        return f"sched_setattr failed: {os.strerror(error)}"
    if seconds is not None and current_slice(tid) != runtime / 1e9:
        return "this kernel has no per-thread slices (Linux 6.12 or later has)"
    return None


def _set_attr(tid: int, policy: int, runtime_ns: int) -> int:
    """`sched_setattr` for thread `tid` (0: the calling thread), keeping its nice value;
    0, or the errno (ESRCH if the thread has ended)."""
    calls = _syscalls()
    assert calls is not None
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return errno.ESRCH
    attr = ctypes.create_string_buffer(
        _ATTR.pack(_ATTR.size, policy, 0, nice, 0, runtime_ns, 0, 0), _ATTR.size
    )
    if _libc().syscall(calls[0], tid, attr, 0) != 0:
        return ctypes.get_errno()
    return 0


def ask_for_short_slices(seconds: float = LOOP_SLICE) -> str | None:
    """(the event loop's thread) Ask for short slices; None if granted, else why not."""
    return set_slice(seconds)


def ask_for_realtime(priority: int = LOOP_PRIORITY) -> str | None:
    """(the event loop's thread) Run under SCHED_FIFO at `priority`, the threads and
    processes it starts under the default policy; None if granted, else why not."""
    policy = getattr(os, "SCHED_FIFO", None)
    reset_on_fork = getattr(os, "SCHED_RESET_ON_FORK", None)
    if policy is None or reset_on_fork is None:
        return f"no SCHED_FIFO on {platform.system()}"
    try:
        os.sched_setscheduler(0, policy | reset_on_fork, os.sched_param(priority))
    except OSError as error:
        why = f"sched_setscheduler failed: {error.strerror}"
        if error.errno == errno.EPERM:
            why += " (it needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at least the priority)"
        return why
    return None


def leave_realtime(slice_seconds: float | None) -> None:
    """(a thread under SCHED_FIFO) Back to the default policy, with a slice of
    `slice_seconds` where the kernel has per-thread slices."""
    if set_slice(slice_seconds) is not None:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


class RealtimeLoop:
    """The event loop thread's real-time policy, held while the loop leaves most of its
    core to other threads (`hold`, a task of the loop, measures its share each window).
    """

    def __init__(self, priority: int, slice_seconds: float | None) -> None:
        self.priority = priority
        self.slice_seconds = slice_seconds
        self.realtime = False

    def start(self) -> str | None:
        """Ask for the policy; None if granted, else why not."""
        why_not = ask_for_realtime(self.priority)
        self.realtime = why_not is None
        return why_not

    def observe(self, busy: float) -> str | None:
        """After a window in which the loop used `busy` of a core: leave the policy or
        take it back; what changed (None: nothing)."""
        if self.realtime and busy > REALTIME_MOST_BUSY:
            leave_realtime(self.slice_seconds)
            self.realtime = False
            return (
                f"busy {busy:.0%} of a core: off the real-time policy "
                f"until under {REALTIME_RESUME_BUSY:.0%}"
            )
        if not self.realtime and busy < REALTIME_RESUME_BUSY and self.start() is None:
            return f"busy {busy:.0%} of a core: real-time priority {self.priority} again"
        return None

    async def hold(self, window: float = REALTIME_WINDOW) -> None:
        """Forever (on the loop's thread): each `window`, `observe` the loop's share."""
        wall, cpu = time.monotonic(), time.thread_time()
        while True:
            await anyio.sleep(window)
            now, used = time.monotonic(), time.thread_time()
            change = self.observe((used - cpu) / max(now - wall, 1e-9))
            wall, cpu = now, used
            if change is not None:
                log.info("event loop thread: %s", change)


def as_model_thread() -> None:
    """(a thread about to run the forward) Run as a batch job with the default slice,
    once per thread, before the thread starts torch's worker threads, which inherit it."""
    if not getattr(_defaults, "done", False):
        _defaults.done = True
        _batch_policy(0)


def every_thread_as_model_thread() -> None:
    """(the model worker process, at its start) The batch policy and the default slice
    for each thread this process has; the ones it starts later inherit them."""
    for tid in threads_of_this_process():
        _batch_policy(tid)
    _defaults.done = True


def threads_of_this_process() -> list[int]:
    """The ids of this process's threads (0, the calling one, where there is no /proc)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _batch_policy(tid: int) -> None:
    """SCHED_BATCH and the default slice for thread `tid` (0: the calling one), keeping
    its nice value. Where `sched_setattr` is refused or missing, the policy alone (a
    thread there has no slice of its own); where that is refused too, the default policy
    serves, preempted more often."""
    if _syscalls() is not None and _set_attr(tid, _SCHED_BATCH, 0) in (0, errno.ESRCH):
        return
    if hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass


def model_cores(
    setting: str, threads: int | None, allowed: set[int], environ: Mapping[str, str]
) -> frozenset[int] | None:
    """The cores a model worker of `threads` threads keeps to, by `setting`
    (`EngineConfig.worker_cores`): the cores it lists (`listed_cores`); "auto", the last
    `threads` of the `allowed` ones, or None (every core) where its threads fill them
    (`threads` None is torch's default, one a core) or the user binds OpenMP's threads
    (`OPENMP_BINDINGS`); "all", None."""
    if setting == "all":
        return None
    if setting != "auto":
        return listed_cores(setting, allowed)
    if not hasattr(os, "sched_setaffinity"):
        return None  # not Linux: the OS places the threads
    if not threads or threads >= len(allowed) or any(name in environ for name in OPENMP_BINDINGS):
        return None
    return frozenset(sorted(allowed)[-threads:])


def listed_cores(setting: str, allowed: set[int]) -> frozenset[int]:
    """The cores of a list such as "2,3"; a `ValueError` if one is not `allowed`, or
    where this OS cannot keep a process to cores."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"worker_cores {setting}: this OS cannot keep a process to cores")
    cores = frozenset(int(core) for core in setting.split(","))
    if not cores <= allowed:
        may_use = ",".join(map(str, sorted(allowed)))
        raise ValueError(f"worker_cores {setting}: this process may use only cores {may_use}")
    return cores


def allowed_cores() -> set[int]:
    """The cores this process may run on (every core where the OS does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def keep_to_cores(cores: frozenset[int]) -> None:
    """(the model worker process, at its start) Each thread it has on `cores`; the ones it
    starts later inherit them."""
    for tid in threads_of_this_process():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass  # it ended since the listing, or the OS refused: it keeps its cores
