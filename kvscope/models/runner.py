"""The model runner: turns one scheduled step into sampled tokens, in a worker thread.

It owns the model and the K/V tensors. `execute` receives an immutable snapshot of the
step (`StepInput`, built on the event loop, so the loop may change sequences while the
forward runs), applies copy-on-write block copies, builds the flat batch and the
attention metadata once, runs the forward, and samples the rows that need a token.
"""

from __future__ import annotations

import threading

import attrs
import torch

from kvscope.cache.kv_cache import KVCache
from kvscope.kernels.attention import build_metadata
from kvscope.kernels.sampling import sample
from kvscope.params import SamplingParams

from .llama import LlamaModel


@attrs.frozen
class ChunkInput:
    token_ids: list[int]  # the tokens computed this step
    start: int  # tokens of the sequence already in the cache
    block_table: list[int]
    sample: bool  # the chunk reaches the sequence's end: draw its next token
    params: SamplingParams
    generator: torch.Generator | None


@attrs.frozen
class StepInput:
    chunks: list[ChunkInput]  # decode chunks (one token) first
    copies: list[tuple[int, int]]


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device

    def execute(self, step: StepInput, abort: threading.Event | None = None) -> list[int | None]:
        """Run one step; returns the sampled token of each chunk (None if it samples none)."""
        with torch.inference_mode():
            self.kv_cache.copy_blocks(step.copies)
            chunks = step.chunks
            input_ids: list[int] = []
            positions: list[int] = []
            sample_rows: list[int] = []
            for chunk in chunks:
                input_ids.extend(chunk.token_ids)
                positions.extend(range(chunk.start, chunk.start + len(chunk.token_ids)))
                if chunk.sample:
                    sample_rows.append(len(input_ids) - 1)
            meta = build_metadata(
                starts=[c.start for c in chunks],
                lengths=[len(c.token_ids) for c in chunks],
                block_tables=[c.block_table for c in chunks],
                block_size=self.kv_cache.block_size,
                device=self.device,
            )
            hidden = self.model.forward(
                torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device),
                meta,
                self.kv_cache,
                abort,
            )
            tokens: list[int | None] = [None] * len(chunks)
            if sample_rows:
                logits = self.model.logits(hidden[torch.tensor(sample_rows, device=self.device)])
                samplers = [c for c in chunks if c.sample]
                drawn = sample(logits, [c.params for c in samplers], [c.generator for c in samplers])
                it = iter(drawn)
                tokens = [next(it) if c.sample else None for c in chunks]
            return tokens
