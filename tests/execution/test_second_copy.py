"""Whether the model worker may load its copy of the model while the engine still
holds its own (`execution/worker_memory.py`): a model that would not fit twice has
the engine's copy released before the worker starts."""

from __future__ import annotations

import torch

from kvscope.execution.worker_memory import SECOND_COPY_SHARE, free_memory, room_for_a_second_copy


def test_a_second_copy_needs_room_in_the_free_memory():
    free = 1000
    assert room_for_a_second_copy(int(SECOND_COPY_SHARE * free), free)
    assert not room_for_a_second_copy(int(SECOND_COPY_SHARE * free) + 1, free)
    assert room_for_a_second_copy(10**12, None)  # unknown: the engine keeps its copy


def test_the_free_memory_of_this_machine_is_read():
    free = free_memory(torch.device("cpu"))
    with open("/proc/meminfo") as meminfo:
        total_kib = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
    assert free is not None and 0 < free <= total_kib * 1024
