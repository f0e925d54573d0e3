"""The model runner: turns one scheduled step into sampled tokens, in a worker thread.

It owns the model and the K/V tensors. `execute` receives an immutable snapshot of the
step (`StepInput`, built on the event loop, so the loop may change sequences while the
forward runs), applies copy-on-write block copies, builds the flat batch and the
attention metadata once, runs the forward, and samples the rows that need a token.

`StepControl` is how the event loop talks to a running step. At each checkpoint of the
forward (before every layer's attention and MLP) the runner takes the chunks cancelled
since the last one, drops their rows from the batch (so
the remaining layers neither compute them nor touch their KV blocks), and hands their
indices to `StepControl.dropped`, on which the step actor unpins (and so frees)
their blocks on the event loop at once instead of at the end of the step. When no chunk is left, or the abort flag is
set, the forward stops with `StepAborted`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import attrs
import torch

from kvscope.cache.kv_cache import KVCache
from kvscope.kernels.attention import AttentionMetadata, build_metadata, decode_backend
from kvscope.kernels.sampling import RowState, Sampled, sample
from kvscope.params import SamplingParams

from .llama import LayerBatch, LlamaModel, StepAborted

log = logging.getLogger(__name__)


@attrs.frozen
class ChunkInput:
    token_ids: list[int]  # the tokens computed this step
    start: int  # tokens of the sequence already in the cache
    block_table: list[int]
    sample: bool  # the chunk reaches the sequence's end: draw its next token
    params: SamplingParams
    generator: torch.Generator | None
    state: RowState | None = None  # the request's tokens and grammar, when sampling needs them


@attrs.frozen
class StepInput:
    chunks: list[ChunkInput]  # decode chunks (one token) first
    copies: list[tuple[int, int]]


class StepControl:
    """Thread-safe channel from the event loop into the running step."""

    def __init__(self, dropped: Callable[[list[int]], None] | None = None) -> None:
        self.abort = threading.Event()
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()
        self._dropped = dropped

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
        """(worker) These chunks left the batch: their blocks may be released now."""
        if self._dropped is not None:
            self._dropped(chunks)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        # Resolve the decode kernel now: on the CPU this loads it or starts its build.
        decode_backend(self.device.type)
        log.info("linear layers: %s (kernels/linear.py)", model.linear_layout)

    def new_control(self, dropped: Callable[[list[int]], None]) -> StepControl:
        """The control channel the step actor uses for this runner's steps."""
        return StepControl(dropped)

    def execute(self, step: StepInput, control: StepControl | None = None) -> list[Sampled | None]:
        """Run one step; returns the sampled token of each chunk (None if it samples
        none or was dropped)."""
        with torch.inference_mode():
            self.kv_cache.copy_blocks(step.copies)
            chunks = step.chunks
            input_ids: list[int] = []
            positions: list[int] = []
            for chunk in chunks:
                input_ids.extend(chunk.token_ids)
                positions.extend(range(chunk.start, chunk.start + len(chunk.token_ids)))
            live = list(range(len(chunks)))
            checkpoint = None
            if control is not None:
                checkpoint = _Pruner(self, chunks, live, control)
            hidden = self.model.forward(
                torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device),
                self.metadata(chunks, live),
                self.kv_cache,
                checkpoint,
            )
            tokens: list[Sampled | None] = [None] * len(chunks)
            rows, samplers, row = [], [], 0
            for index in live:  # `live` lost the dropped chunks; rows follow its order
                row += len(chunks[index].token_ids)
                if chunks[index].sample:
                    rows.append(row - 1)
                    samplers.append(index)
            if rows:
                logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
                drawn = sample(
                    logits,
                    [chunks[i].params for i in samplers],
                    [chunks[i].generator for i in samplers],
                    [chunks[i].state for i in samplers],
                )
                for index, token in zip(samplers, drawn, strict=True):
                    tokens[index] = token
            return tokens

    def metadata(self, chunks: list[ChunkInput], live: list[int]) -> AttentionMetadata:
        return build_metadata(
            starts=[chunks[i].start for i in live],
            lengths=[len(chunks[i].token_ids) for i in live],
            block_tables=[chunks[i].block_table for i in live],
            block_size=self.kv_cache.block_size,
            device=self.device,
        )


class _Pruner:
    """The forward's `checkpoint` hook: drops the rows of cancelled chunks."""

    def __init__(
        self, runner: ModelRunner, chunks: list[ChunkInput], live: list[int], control: StepControl
    ) -> None:
        self.runner = runner
        self.chunks = chunks
        self.live = live  # shared with `execute`, which samples what is left in it
        self.control = control

    def __call__(self, batch: LayerBatch) -> None:
        if self.control.abort.is_set():
            raise StepAborted
        cancelled = self.control.take_cancelled()
        if not cancelled.intersection(self.live):
            return
        keep_rows: list[int] = []
        row = 0
        kept, gone = [], []
        for index in self.live:
            length = len(self.chunks[index].token_ids)
            if index in cancelled:
                gone.append(index)
            else:
                kept.append(index)
                keep_rows.extend(range(row, row + length))
            row += length
        self.live[:] = kept
        if not kept:
            raise StepAborted
        rows = torch.tensor(keep_rows, device=self.runner.device)
        batch.hidden = batch.hidden[rows]
        batch.cos = batch.cos[rows]
        batch.sin = batch.sin[rows]
        batch.meta = self.runner.metadata(self.chunks, kept)
        self.control.dropped(gone)
