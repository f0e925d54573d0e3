"""Whether an engine serves at full speed yet, and what it still waits for.

An engine answers as soon as its model is loaded (the thread worker and the torch
fallbacks serve at once), but after a first start three things bring it to full speed
later: the compiled CPU library's build (`kernels/cpu_decode.py`, ~17 s where nothing
is cached), the model worker process (`worker="process"`: it loads its own copy of the
model and warms up before it takes over, 5-26 s), and the thread worker's idle warm-up
of the row buckets (`execution/warm_up.py`). `waiting_for` names those still pending; an
engine is *ready* when it names none. `/stats` (`ready`), `/metrics`
(`kvscope_ready`) and `GET /ready` read it, and `kvscope bench` waits for it before it
measures. Liveness is another matter: `/health` answers as soon as the server serves.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvscope.kernels.cpu_decode import cpu_kernel

__all__ = ["KERNEL_BUILD", "MODEL_WORKER", "WARM_UP", "waiting_for"]

KERNEL_BUILD = "kernel build"
MODEL_WORKER = "model worker"
WARM_UP = "warm-up"


def waiting_for(device: torch.device, worker: str, stats: Mapping[str, int]) -> tuple[str, ...]:
    """What the engine with these `stats` (`Engine.stats()`) still waits for before it
    serves at full speed; empty once it does."""
    waiting = []
    kernel = cpu_kernel()
    if device.type == "cpu" and not kernel.ready and kernel.why_not is None:
        waiting.append(KERNEL_BUILD)  # (given up: the fallback is as fast as it gets)
    if worker == "process" and not stats["worker_pid"]:
        waiting.append(MODEL_WORKER)
    if stats["warm_up_pending"]:
        waiting.append(WARM_UP)
    return tuple(waiting)
