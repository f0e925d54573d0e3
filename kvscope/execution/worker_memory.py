"""Whether a model worker may load its copy of the model while the engine holds its
own: the device's free memory, and the share of it a second copy may take."""

from __future__ import annotations

import torch

#: How much of the device's free memory a second copy of the model may take while the
#: worker loads it beside the engine's; past that, the engine's copy goes first.
SECOND_COPY_SHARE = 0.8


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
