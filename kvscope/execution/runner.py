"""The model runner: turns one scheduled step into sampled tokens, in a worker thread.

It owns the model and the K/V tensors. `execute` receives an immutable snapshot of the
step (`StepInput`, built on the event loop, so the loop may change sequences while the
forward runs), applies copy-on-write block copies, builds the flat batch and the
attention metadata once, runs the forward, samples the rows that need a token, and
scores the prompt tokens of the chunks that ask (`prompt_logprobs`).

At each checkpoint of the forward (before every layer's attention and MLP, and between a
long linear's pieces, `kernels/slicing.py`) the runner takes the chunks cancelled since
the last one (`StepControl`, `execution/step_input.py`): their rows leave the batch at the
next checkpoint that allows it (the remaining layers neither compute them nor touch their
KV blocks) and go to `StepControl.dropped`, a hook nothing waits for. With no chunk left,
or the abort flag set, it raises `StepAborted`. Every gap between two checkpoints (and
from the step's start to the first, and from the last to the step's end) is counted in
`gaps` (`execution/gaps.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs
import torch

from kvscope.cache.kv_cache import KVCache
from kvscope.config import EngineConfig
from kvscope.kernels.attention import AttentionMetadata, build_metadata, decode_backend
from kvscope.kernels.sampling import Sampled, sample
from kvscope.kernels.slicing import LinearSlicer
from kvscope.models.llama import LayerBatch, LlamaModel, StepAborted
from kvscope.models.lora import LoraAdapter, LoraRows, lora_rows, read_adapter
from kvscope.scheduling import as_model_thread

from .gaps import GapRecorder
from .many_rows import score_prompts, verify_drafts
from .step_input import ChunkInput, StepControl, StepInput

log = logging.getLogger(__name__)

_DEFAULT_GAP = EngineConfig().checkpoint_gap  # one place for the default


class ModelRunner:
    """A `Runner` (`execution/runner_protocol.py`) that runs each step in a thread of
    this process: it has no worker, so none has a pid, restarts or loses the cache."""

    pid: int | None = None
    restarts = 0
    caches_lost = 0
    cache_lost = False

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        *,
        checkpoint_gap: float = _DEFAULT_GAP,
        gaps: GapRecorder | None = None,
        adapters: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        #: The LoRA adapters' directories by name: the engine's table, which it changes
        #: (`Engine.load_adapter`), or a worker's copy, changed by `StepInput.adapters`.
        #: An adapter is read into the model when a step first uses it.
        self.adapters = adapters if adapters is not None else {}
        self.device = model.device
        #: The gaps between the forward's checkpoints (a worker process is handed its
        #: parent's, in shared memory, so both count into one histogram).
        self.gaps = gaps if gaps is not None else GapRecorder()
        # Resolve the decode kernel now: on the CPU this loads it or starts its build,
        # so the linears below are measured on the compiled path where it is cached.
        decode_backend(self.device.type)
        self.slicer: LinearSlicer | None = None
        if checkpoint_gap > 0 and self.device.type == "cpu":
            self.slicer = LinearSlicer(checkpoint_gap)
            for linear in model.linears():  # measure them now, not in a step
                self.slicer.cost(linear)
        log.info("linear layers: %s (kernels/linear.py)", model.linear_layout)
        self._model_bytes = model.weight_bytes()

    @property
    def model_bytes(self) -> int:
        """The memory this runner's model holds (0 once released)."""
        return 0 if self.model.released else self._model_bytes

    def release_model(self) -> None:
        """Free the model's weights: this runner cannot run a step again (a model
        worker process runs them with its own copy)."""
        self.model.release_weights()
        if self.slicer is not None:
            self.slicer.forget()

    def new_control(self) -> StepControl:
        """The control channel the step actor uses for this runner's steps."""
        return StepControl()

    def recovered(self, losses: int) -> None:
        """No cache is lost here (`cache_lost`): nothing to recover from."""

    async def execute_on_loop(self, step: StepInput) -> list[Sampled | None] | None:
        """None: each step runs in the model thread (`execute`)."""
        return None

    def execute(self, step: StepInput, control: StepControl | None = None) -> list[Sampled | None]:
        """Run one step; returns each chunk's output: its token and prompt scores (None
        if it has neither or was dropped)."""
        return self.execute_on(self.kv_cache, self.gaps, step, control)

    def execute_on(
        self, cache: KVCache, gaps: GapRecorder, step: StepInput, control: StepControl | None
    ) -> list[Sampled | None]:
        """`execute` on `cache` (the warm-up's scratch cache, `execution/warm_up.py`),
        counting the checkpoint gaps in `gaps`."""
        as_model_thread()  # this thread and the torch threads it starts
        with torch.inference_mode():
            adapters = self._step_adapters(step)
            cache.copy_blocks(step.copies)
            chunks = step.chunks
            input_ids: list[int] = []
            positions: list[int] = []
            for chunk in chunks:
                input_ids.extend(chunk.token_ids)
                positions.extend(range(chunk.start, chunk.start + len(chunk.token_ids)))
            live = list(range(len(chunks)))
            pruner = (
                None if control is None else _Pruner(self, chunks, live, control, gaps, adapters)
            )
            slicer = self.slicer if pruner is not None else None
            if pruner is not None:
                gaps.start()
            try:
                hidden = self.model.forward(
                    torch.tensor(input_ids, device=self.device),
                    torch.tensor(positions, device=self.device),
                    self.metadata(chunks, live),
                    cache,
                    pruner,
                    slicer,
                    self.lora_rows(chunks, live, adapters),
                )
                in_batch = pruner.in_batch if pruner is not None else live
                return self._sample(chunks, live, list(in_batch), hidden, pruner, slicer)
            finally:
                if pruner is not None:
                    gaps.end()

    def _sample(
        self,
        chunks: list[ChunkInput],
        live: list[int],
        in_batch: list[int],
        hidden: torch.Tensor,
        pruner: _Pruner | None,
        slicer: LinearSlicer | None,
    ) -> list[Sampled | None]:
        """Draw the tokens of the chunks that sample, and score the prompt tokens of
        those that ask; `hidden`'s rows are `in_batch`'s chunks, and only those still
        in `live` at the end get an output."""
        rows, samplers, scored, verified, row = [], [], [], [], 0
        drawn: dict[int, Sampled] = {}
        for index in in_batch:
            chunk = chunks[index]
            if chunk.prompt_targets:
                scored.append((index, row))
            row += len(chunk.token_ids)
            if chunk.sample and chunk.draft:
                verified.append((index, row - len(chunk.draft) - 1))
            elif chunk.sample and chunk.params.embed:
                drawn[index] = Sampled(None, embedding=embedding(hidden[row - 1]))
            elif chunk.sample:
                rows.append(row - 1)
                samplers.append(index)
        if rows:
            logits = self.model.logits(
                hidden[torch.tensor(rows, device=self.device)], pruner, slicer
            )
            sampled = sample(
                logits,
                [chunks[i].params for i in samplers],
                [chunks[i].generator for i in samplers],
                [chunks[i].state for i in samplers],
            )
            drawn.update(zip(samplers, sampled, strict=True))

        def head(rows: list[int]) -> torch.Tensor:  # the output head over these rows
            return self.model.logits(hidden[torch.tensor(rows, device=self.device)], pruner, slicer)

        drawn.update(verify_drafts(chunks, verified, head))
        prompt = score_prompts(chunks, scored, head)
        tokens: list[Sampled | None] = [None] * len(chunks)
        for index in live:  # not released at a checkpoint in the output head
            token = drawn.get(index)
            if index in prompt:
                token = attrs.evolve(token or Sampled(None), prompt_logprobs=prompt[index])
            tokens[index] = token
        return tokens

    def _step_adapters(self, step: StepInput) -> dict[str, LoraAdapter]:
        """Apply the step's changes to the adapters' table; return the adapters its
        chunks run with, reading into the model each one it does not hold yet. The
        step keeps its own references, since the engine may unload an adapter while the
        step runs: only once no request uses it, but a step may still hold the rows of
        a request cancelled as it started. Such a row, whose adapter was unloaded even
        before, runs on the base model until its first checkpoint drops it."""
        model = self.model
        for name, moved_to in step.adapters.items():
            model.adapters.pop(name, None)  # gone, or read again from its new directory
            if moved_to is None:
                self.adapters.pop(name, None)
            else:
                self.adapters[name] = moved_to
        used: dict[str, LoraAdapter] = {}
        for chunk in step.chunks:
            wanted = chunk.params.lora
            if wanted is None or wanted in used:
                continue
            adapter = model.adapters.get(wanted)
            path = self.adapters.get(wanted)
            if adapter is None and path is not None:
                adapter = read_adapter(
                    wanted, path, model.config, device=self.device, max_rank=None
                )
                model.adapters[wanted] = adapter
            if adapter is not None:
                used[wanted] = adapter
        return used

    def add_adapter(self, adapter: LoraAdapter) -> None:
        """(event loop) Hold `adapter`, which the engine read, rather than read it again
        when a step first uses it (nothing, once this copy released its weights)."""
        if not self.model.released:
            self.model.adapters[adapter.name] = adapter

    def forget_adapter(self, name: str) -> None:
        """(event loop) Free the adapter `name`, which the engine no longer serves and no
        request uses."""
        self.model.adapters.pop(name, None)

    def lora_rows(
        self, chunks: list[ChunkInput], live: list[int], adapters: Mapping[str, LoraAdapter]
    ) -> LoraRows | None:
        """Which of the live chunks' rows run with which of the step's LoRA adapters."""
        rows = [(chunks[i].params.lora, len(chunks[i].token_ids)) for i in live]
        return lora_rows(adapters, rows, self.device)

    def metadata(self, chunks: list[ChunkInput], live: list[int]) -> AttentionMetadata:
        starts: list[int] = []
        lengths: list[int] = []
        tables: list[list[int]] = []
        for chunk in (chunks[i] for i in live):
            if chunk.draft:
                # A chunk that verifies a draft attends as decode rows, one a position,
                # each over the cache up to itself: the kernels and roundings of decoding
                # the tokens one at a time, so speculation draws what decoding draws.
                count = len(chunk.token_ids)
                starts += range(chunk.start, chunk.start + count)
                lengths += [1] * count
                tables += [chunk.block_table] * count
            else:
                starts.append(chunk.start)
                lengths.append(len(chunk.token_ids))
                tables.append(chunk.block_table)
        return build_metadata(
            starts=starts,
            lengths=lengths,
            block_tables=tables,
            block_size=self.kv_cache.block_size,
            device=self.device,
        )


def embedding(hidden: torch.Tensor) -> bytes:
    """A row's final hidden state as an embedding: L2-normalized, float32 bytes."""
    return torch.nn.functional.normalize(hidden.float(), dim=-1).cpu().numpy().tobytes()


class _Pruner:
    """The forward's `checkpoint` hook: drops the rows of cancelled chunks."""

    def __init__(
        self,
        runner: ModelRunner,
        chunks: list[ChunkInput],
        live: list[int],
        control: StepControl,
        gaps: GapRecorder,
        adapters: Mapping[str, LoraAdapter],
    ) -> None:
        self.runner = runner
        self.adapters = adapters
        self.gaps = gaps
        self.chunks = chunks
        self.live = live  # the chunks still wanted; shared with `execute`, which samples them
        self.in_batch = list(live)  # the chunks whose rows the batch holds, in order
        self.control = control

    def __call__(self, batch: LayerBatch | None) -> None:
        self.gaps.mark()
        if self.control.abort.is_set():
            raise StepAborted
        cancelled = self.control.take_cancelled()
        gone = [index for index in self.live if index in cancelled]
        if gone:
            self.live[:] = [index for index in self.live if index not in cancelled]
        if batch is not None and len(self.in_batch) != len(self.live):
            self._drop_rows(batch)
        if gone:
            if not self.live:
                raise StepAborted
            self.control.dropped(gone)

    def _drop_rows(self, batch: LayerBatch) -> None:
        """Keep only the rows of the chunks in `live`."""
        keep_rows: list[int] = []
        row = 0
        for index in self.in_batch:
            length = len(self.chunks[index].token_ids)
            if index in self.live:
                keep_rows.extend(range(row, row + length))
            row += length
        self.in_batch = list(self.live)
        if not self.live:
            return
        rows = torch.tensor(keep_rows, device=self.runner.device)
        batch.hidden = batch.hidden[rows]
        batch.cos = batch.cos[rows]
        batch.sin = batch.sin[rows]
        if batch.qkv is not None:
            batch.qkv = batch.qkv[rows]
        batch.meta = self.runner.metadata(self.chunks, self.live)
        batch.lora = self.runner.lora_rows(self.chunks, self.live, self.adapters)
