"""What a step is, as the model runner receives it, and how the event loop talks to it
while it runs.

`StepInput` is an immutable snapshot of one scheduled step, built on the event loop (so
the loop may change sequences while the forward runs): its chunks (`ChunkInput`, one a
sequence) and the block copies to apply first.

`StepControl` is how the event loop talks to a running step. A request that ends mid-step
has the step actor's `leave` (actors/step.py) unpin (so free) its chunk's blocks on the
loop at once, not at the step's end, and mark the chunk (`StepControl.cancel`); the
runner's next checkpoint takes it (`take_cancelled`, `execution/runner.py`). Setting
`abort` stops the whole step at its next checkpoint.
"""

from __future__ import annotations

import threading

import attrs
import torch

from kvscope.kernels.sampling import RowState
from kvscope.params import SamplingParams


@attrs.frozen
class ChunkInput:
    token_ids: list[int]  # the tokens computed this step
    start: int  # tokens of the sequence already in the cache
    block_table: list[int]
    sample: bool  # the chunk reaches the sequence's end: draw its next token
    params: SamplingParams
    generator: torch.Generator | None
    state: RowState | None = None  # the request's tokens and grammar, when sampling needs them
    #: For a request with `prompt_logprobs`: the prompt tokens this chunk's first rows
    #: predict (each row the token after its own), whose log-probabilities it returns.
    prompt_targets: list[int] = attrs.field(factory=list)
    #: A draft to verify: the last `len(draft)` of `token_ids` (speculative decoding);
    #: the chunk then samples at each of its rows (`kernels/speculative.py`).
    draft: list[int] = attrs.field(factory=list)


@attrs.frozen
class StepInput:
    chunks: list[ChunkInput]  # decode chunks (one token) first
    copies: list[tuple[int, int]]
    #: Changes to the LoRA adapters' table since the last step, for a runner that keeps
    #: its own (a model worker's): each name's new directory, or None where it is gone.
    adapters: dict[str, str | None] = attrs.field(factory=dict)


class StepControl:
    """Thread-safe channel from the event loop into the running step."""

    def __init__(self) -> None:
        self.abort = threading.Event()
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()

    def reset(self) -> None:
        with self._lock:
            self._cancelled.clear()
        self.abort.clear()

    def cancel(self, chunk: int) -> None:
        """(event loop) Chunk `chunk` of the running step is no longer wanted."""
        with self._lock:
            self._cancelled.add(chunk)

    def take_cancelled(self) -> set[int]:
        """(worker) The chunks cancelled since the last call."""
        with self._lock:
            taken, self._cancelled = self._cancelled, set()
        return taken

    def dropped(self, chunks: list[int]) -> None:
        """(worker) These chunks left the batch. Nothing waits for it (the loop freed
        their blocks when it cancelled them); a hook for whoever observes the forward."""
