"""How late the event loop serves a file descriptor that became ready: its lag.

A cancel arrives as a readable socket, so the lag that matters is the time from a
descriptor becoming ready to the task that waits on it running. `LagProbe` measures
exactly that with a Linux `timerfd`: the kernel makes it readable at a set instant
(nanosecond clock, no GIL, no thread), the monitor task waits for it with
`anyio.wait_readable`, and the lag is the time from that instant to the task's wake-up.

A timer (`anyio.sleep`) measures something else besides: epoll's timeout is in whole
milliseconds, rounded up, so a sleeping task wakes 0-1 ms late on an idle loop, which
no socket suffers. Where `timerfd` cannot be had (not Linux, no libc), the probe falls
back to the timer and `method` says so.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable

import anyio

log = logging.getLogger("kvscope.web")

_CLOCK_MONOTONIC = 1  # the clock of time.monotonic() on Linux
_TFD_TIMER_ABSTIME = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _TimerFd:
    """A one-shot monotonic timer whose expiry makes a descriptor readable."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._settime = libc.timerfd_settime
        self.fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")

    def arm(self, at: float) -> None:
        """Become readable at `at` (time.monotonic())."""
        seconds = int(at)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(seconds, int((at - seconds) * 1e9)))
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def clear(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)


class LagProbe:
    """Samples the loop's lag every `interval` seconds into `observe`, forever."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self.observe = observe
        try:
            self._timer: _TimerFd | None = _TimerFd()
            self.method = "timerfd"
        except (OSError, AttributeError) as error:  # not Linux, or no timerfd in libc
            log.info("event-loop lag: no timerfd (%s); measured with a timer instead", error)
            self._timer = None
            self.method = "timer"

    async def run(self, interval: float) -> None:
        timer = self._timer
        try:
            while True:
                due = time.monotonic() + interval
                if timer is None:
                    await anyio.sleep(interval)
                else:
                    timer.arm(due)
                    await anyio.wait_readable(timer.fd)
                    timer.clear()
                self.observe(max(0.0, time.monotonic() - due))
        finally:
            if timer is not None:
                timer.close()
