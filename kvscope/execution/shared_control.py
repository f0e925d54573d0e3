"""The step's control block in shared memory, between the engine and its model worker
process: one shared byte for "abort" and one per chunk for "cancelled". The loop writes
them (`SharedStepControl`) and the worker's checkpoints read them (one copy at a time,
`WorkerControl`), with no message in between. A cancelled chunk's blocks were freed by
the loop when it set the flag; the worker's checkpoint only drops its rows."""

from __future__ import annotations

import numpy as np

from .step_input import StepControl


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
