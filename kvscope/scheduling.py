"""How the server's threads ask Linux's scheduler for the CPU: the event loop's thread
asks for short time slices, and the model's threads keep the default.

Where the model fills every core, a woken event loop waits for a model thread to give up
its CPU. Linux's EEVDF scheduler (6.6 on) runs the eligible thread whose virtual
deadline, one slice past where it stands, comes first; since 6.12 a thread may ask for
its own slice (`sched_setattr` with SCHED_OTHER and `sched_runtime`, no privilege
needed). The loop asks for the shortest, `LOOP_SLICE`, so when it wakes its deadline is
earlier than a model thread's and it runs sooner. `bench cancel` on the 2-core machine,
two runs each, 2 model threads (thread / process worker): the loop lag p50 0.26-0.29 /
0.36 ms against 0.44-0.46 / 0.34-0.36, its p99 4.4-4.5 / 4.2-4.5 against 4.7-4.9 /
4.5-4.7 (docs/benchmarks/README.md, session 8).

A thread starts with its creator's slice, so a thread that runs the forward asks for
the default back before its first step (`keep_default_slice`), and so does every thread
of the model worker process when it starts (`default_slice_every_thread`): short slices
there would only mean more switches between the model's own threads.

Elsewhere (not Linux on x86-64 or arm64, a kernel before 6.12, a seccomp filter that
refuses the call) nothing changes, and `ask_for_short_slices` says why.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading

#: The slice the event loop's thread asks for, in seconds (the kernel's shortest).
LOOP_SLICE = 0.0001

_SCHED_OTHER = 0
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
    thread), keeping its policy and nice value; None if the kernel holds it, else why not."""
    calls = _syscalls()
    if calls is None:
        return f"no sched_setattr on {platform.system()} {platform.machine()}"
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    runtime = 0 if seconds is None else round(seconds * 1e9)
    attr = ctypes.create_string_buffer(
        _ATTR.pack(_ATTR.size, _SCHED_OTHER, 0, nice, 0, runtime, 0, 0), _ATTR.size
    )
    if _libc().syscall(calls[0], tid, attr, 0) != 0:
        return f"sched_setattr failed: {os.strerror(ctypes.get_errno())}"
    if seconds is not None and current_slice(tid) != runtime / 1e9:
        return "this kernel has no per-thread slices (Linux 6.12 or later has)"
    return None


def ask_for_short_slices(seconds: float = LOOP_SLICE) -> str | None:
    """(the event loop's thread) Ask for short slices; None if granted, else why not."""
    return set_slice(seconds)


def keep_default_slice() -> None:
    """(a thread about to run the forward) Ask for the default slice back, once per
    thread, before the thread starts torch's worker threads, which inherit it."""
    if not getattr(_defaults, "done", False):
        _defaults.done = True
        if current_slice() is not None:
            set_slice(None)


def default_slice_every_thread() -> None:
    """(the model worker process, at its start) The default slice for each thread this
    process has; the ones it starts later inherit it."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            set_slice(None, tid)
        except ProcessLookupError:
            pass  # it ended since the listing
    _defaults.done = True
