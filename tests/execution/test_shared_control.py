"""The shared control block between the engine and its model worker
(`execution/shared_control.py`): the parent writes the abort flag and the cancelled chunks (`SharedStepControl`), the
worker's checkpoints read them (`WorkerControl`), in another process, while they change.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.synchronize import Event

import torch

from kvscope.execution.shared_control import SharedStepControl, WorkerControl

CHUNKS = 256


def _cancel_and_reset_forever(flags: torch.Tensor, started: Event, stop: Event) -> None:
    """(child) The parent's side at full speed: cancel chunks one by one, reset, again."""
    control = SharedStepControl(flags.numpy())
    started.set()
    chunk = 0
    while not stop.is_set():
        control.cancel(chunk)
        chunk = (chunk + 1) % CHUNKS
        if chunk == 0:
            control.reset()


def test_the_worker_reads_what_the_parent_wrote():
    flags = torch.zeros(CHUNKS + 1, dtype=torch.uint8).share_memory_()
    parent, worker = SharedStepControl(flags.numpy()), WorkerControl(flags.numpy())
    assert worker.take_cancelled() == set() and not worker.abort.is_set()
    parent.cancel(3)
    parent.cancel(7)
    assert worker.take_cancelled() == {3, 7}
    assert worker.take_cancelled() == set()  # each cancel is taken once a step
    parent.abort.set()
    assert worker.abort.is_set()
    parent.reset()
    worker.reset()
    assert worker.take_cancelled() == set() and not worker.abort.is_set()


def test_the_worker_reads_the_flags_while_the_parent_writes_them():
    """Failed in CI's soak test once: numpy's nonzero counts the flags twice and raised
    "number of non-zero array elements changed" when the loop cancelled in between."""
    flags = torch.zeros(CHUNKS + 1, dtype=torch.uint8).share_memory_()
    context = multiprocessing.get_context("spawn")
    started, stop = context.Event(), context.Event()
    writer = context.Process(target=_cancel_and_reset_forever, args=(flags, started, stop))
    writer.start()
    try:
        assert started.wait(60), "the writer process did not start"
        worker = WorkerControl(flags.numpy())
        for _ in range(200_000):
            worker.reset()
            assert worker.take_cancelled() <= set(range(CHUNKS))
    finally:
        stop.set()
        writer.join(10)
    assert writer.exitcode == 0
