"""The warm-up: a step for each row bucket, run before the real steps need its kernels.

oneDNN generates its kernels for a row count the first time it meets it, and the
second call is as slow again; a prepacked multiply runs at a row bucket
(`linear.bucket_rows`), so a few dozen row counts cover every step the budget allows.
Served, the first 2,048-token step took 447 ms of the worker's CPU against 222-264 for
the ones after it, and the first wave's prompts waited behind it. `WarmUp` holds one
step for each bucket of up to the step budget (`WARM_UP_MOST_ROWS` at most): up to
`BUCKET_SMALL_UNTIL` rows a step is of one-token rows (decode steps, and the logits of
as many rows); past it, of prompts of `WARM_UP_CHUNK` tokens. They run on a scratch
cache, counted in a histogram of their own, so the shared cache and the checkpoint-gap
figures never see them; the slicer prepacks its pieces in them too.

Two owners run them. The model worker process runs them all before it reports ready
(`warm_up_now`; the engine serves on its own copy meanwhile). With the thread worker
the step actor runs them one at a time while it has no work (`actors/step.py`): a
request that arrives stops the running one at its next checkpoint, and it stays
pending. A model none of whose linears runs at buckets (float32, or a CPU without
oneDNN's prepacked layouts) has nothing to warm up.
"""

from __future__ import annotations

import logging
import time

from kvscope.cache.block_table import blocks_needed
from kvscope.cache.kv_cache import KVCache
from kvscope.kernels.linear import BUCKET_SMALL_UNTIL, row_buckets
from kvscope.models.llama import StepAborted
from kvscope.params import SamplingParams

from .gaps import GapRecorder
from .runner import ModelRunner
from .step_input import ChunkInput, StepControl, StepInput

log = logging.getLogger(__name__)

#: The prompt length a warm-up step past `BUCKET_SMALL_UNTIL` rows is cut into (its
#: rows are what count).
WARM_UP_CHUNK = 256
#: Most rows the warm-up builds kernels for: 44 buckets, ~3 s on the 2-core machine for
#: the reference model. A bigger step budget's buckets are built when first met (~30 ms
#: each), rather than holding the worker back for minutes.
WARM_UP_MOST_ROWS = 2048


class WarmUp:
    """The warm-up steps of one runner for a step budget of `tokens` rows."""

    def __init__(self, runner: ModelRunner, tokens: int) -> None:
        self.runner = runner
        wanted = (
            tokens > 0
            and not runner.model.released
            and any(linear.in_buckets for linear in runner.model.linears())
        )
        #: The row buckets still to build, smallest first.
        self.pending = row_buckets(min(tokens, WARM_UP_MOST_ROWS)) if wanted else []
        self.built: list[int] = []
        self.seconds = 0.0  # spent in the steps, aborted ones included
        self._cache: KVCache | None = None
        self._gaps = GapRecorder()

    @property
    def done(self) -> bool:
        return not self.pending

    def run_next(self, control: StepControl) -> bool:
        """(model thread) Run the smallest pending bucket's step; False if `control`
        stopped it (the bucket stays pending). The scratch cache is made for the first
        step and dropped after the last."""
        rows = self.pending[0]
        started = time.perf_counter()
        try:
            self.runner.execute_on(self._scratch(), self._gaps, self._step(rows), control)
        except StepAborted:
            return False
        finally:
            self.seconds += time.perf_counter() - started
        self.built.append(self.pending.pop(0))
        if self.done:
            self._cache = None
            log.info(
                "warmed up %d row counts (up to %d rows) in %.1f s",
                len(self.built),
                self.built[-1],
                self.seconds,
            )
        return True

    def _step(self, rows: int) -> StepInput:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        chunks, next_block = [], 0
        for length, blocks in self._chunks(rows):
            table = list(range(next_block, next_block + blocks))
            next_block += blocks
            chunks.append(ChunkInput([0] * length, 0, table, True, params, None))
        return StepInput(chunks, [])

    def _chunks(self, rows: int) -> list[tuple[int, int]]:
        """The (tokens, blocks) of each chunk of the step of `rows` rows."""
        per_chunk = 1 if rows <= BUCKET_SMALL_UNTIL else WARM_UP_CHUNK
        block_size = self.runner.kv_cache.block_size
        lengths = [min(per_chunk, rows - start) for start in range(0, rows, per_chunk)]
        return [(length, blocks_needed(length, block_size)) for length in lengths]

    def _scratch(self) -> KVCache:
        """A cache with room for every pending step, apart from the shared one."""
        if self._cache is None:
            cache = self.runner.kv_cache
            _, _, kv_heads, head_dim = cache.keys[0].shape
            self._cache = KVCache(
                num_layers=len(cache.keys),
                num_blocks=max(
                    sum(blocks for _, blocks in self._chunks(rows)) for rows in self.pending
                ),
                block_size=cache.block_size,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                dtype=cache.keys[0].dtype,
                device=cache.keys[0].device,
                block_major=cache.block_major,
            )
        return self._cache


def warm_up_now(runner: ModelRunner, tokens: int) -> None:
    """Run every warm-up step of a budget of `tokens` rows now (the model worker)."""
    warm_up = WarmUp(runner, tokens)
    while not warm_up.done:
        warm_up.run_next(StepControl())
