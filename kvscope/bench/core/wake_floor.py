"""The machine's own wake-up latency, measured beside a run: how late a sleeping
process wakes on this machine, under the run's load.

An event loop that waits in `epoll_wait` for a timer or a socket is woken by the
kernel the same way, so no server shows a loop lag, or answers a request, faster
than this floor. On the 2-core KVM guest of `docs/benchmarks` a process sleeping
20 ms wakes 0.2 ms late at p50 and 1.3 ms late at p99 on an idle machine, and
1.8 ms at p99 beside one busy core (the model's). The floor is reported next to
the server's figures so that a target is read against what the machine allows.

`WakeFloor` runs a small Python child that sleeps `interval` seconds in `select`
(microsecond timeouts, as the loop's timer) over and over and records how late
each wake-up is; closing its stdin ends it and it answers with the samples. Entering
waits until the child is sampling (its start-up is not part of the run), and the child
always finishes at least one sleep, so a run shorter than `interval` still has a figure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import anyio
import anyio.abc

#: The child: sleep `interval` in select() until stdin closes; print the lateness (s).
SAMPLER = """
import json, select, sys, time
interval = float(sys.argv[1])
late = []
print("ready", flush=True)
watched = [sys.stdin]
while True:
    due = time.monotonic() + interval
    if select.select(watched, [], [], interval)[0]:
        if late:
            break
        watched = []  # stdin closed before the first wake-up: finish that one sleep
        continue
    late.append(time.monotonic() - due)
    if not watched:
        break
json.dump(late, sys.stdout)
"""


class WakeFloor:
    """`async with WakeFloor(0.05) as floor: ...`; then `floor.samples` (seconds)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._process: anyio.abc.Process | None = None
        self._head = b""  # what the child printed up to its samples

    async def __aenter__(self) -> WakeFloor:
        self._process = await anyio.open_process(
            [sys.executable, "-c", SAMPLER, str(self.interval)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        process = self._process
        assert process.stdout is not None
        try:
            while b"\n" not in self._head:  # "ready": the child is sampling
                self._head += await process.stdout.receive()
        except BaseException:
            with anyio.CancelScope(shield=True):
                process.kill()
                await process.wait()
            raise
        self._head = self._head.partition(b"\n")[2]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        process = self._process
        assert process is not None and process.stdin is not None
        assert process.stdout is not None
        with anyio.CancelScope(shield=True):
            if exc[0] is not None:  # the run failed: no figures to keep
                process.kill()
                await process.wait()
                return
            await process.stdin.aclose()
            chunks = [chunk async for chunk in process.stdout]
            await process.wait()
        if process.returncode == 0:
            self.samples = [max(0.0, x) for x in json.loads(self._head + b"".join(chunks))]
