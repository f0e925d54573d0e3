"""How the server's threads ask Linux's scheduler for the CPU: the event loop's thread
asks for short time slices, and the model's threads run as a batch job.

Where the model fills every core, a woken event loop waits for a model thread to give up
its CPU. Linux's EEVDF scheduler (6.6 on) runs the eligible thread whose virtual
deadline, one slice past where it stands, comes first; since 6.12 a thread may ask for
its own slice (`sched_setattr` with SCHED_OTHER and `sched_runtime`, no privilege
needed). The loop asks for the shortest, `LOOP_SLICE`, so when it wakes its deadline is
earlier than a model thread's and it runs sooner. `bench cancel` on the 2-core machine,
two runs each, 2 model threads (thread / process worker): the loop lag p50 0.26-0.29 /
0.36 ms against 0.44-0.46 / 0.34-0.36, its p99 4.4-4.5 / 4.2-4.5 against 4.7-4.9 /
4.5-4.7 (docs/benchmarks/README.md, session 8).

The model's threads run under SCHED_BATCH (`as_model_thread`), with the default slice:
the kernel never lets a batch thread's wake-up preempt the thread that is running (the
tick shares the CPU out, by the same weights), so the model worker, woken by the step
the loop has just sent, no longer takes the CPU from the loop in the middle of its
pass. Measured with the step sent from the loop (process worker, reference model, 2
threads), the send's p90 was 2.6 ms of wall time for 0.02 ms at p50: the loop was
descheduled at the send. Served tokens/s, the same server with and without, three
interleaved pairs: 90-102 against 84-91 at one stream, 337-396 against 318-377 at 32
(docs/benchmarks/README.md, session 11). A thread starts with its creator's policy and
slice, so a thread that runs the forward takes the batch policy before its first step
and before it starts torch's threads, which inherit it; the model worker process sets
it on every thread it has when it starts (`every_thread_as_model_thread`).

Elsewhere (not Linux, a kernel before 6.12 for the slices, a seccomp filter that
refuses the call) nothing changes, and `ask_for_short_slices` says why.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import threading

#: The slice the event loop's thread asks for, in seconds (the kernel's shortest).
LOOP_SLICE = 0.0001

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


def as_model_thread() -> None:
    """(a thread about to run the forward) Run as a batch job with the default slice,
    once per thread, before the thread starts torch's worker threads, which inherit it."""
    if not getattr(_defaults, "done", False):
        _defaults.done = True
        _batch_policy(0)


def every_thread_as_model_thread() -> None:
    """(the model worker process, at its start) The batch policy and the default slice
    for each thread this process has; the ones it starts later inherit them."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        _batch_policy(tid)
    _defaults.done = True


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
