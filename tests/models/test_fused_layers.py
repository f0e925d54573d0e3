"""Decode layers in one compiled call (`kernels/fused_layer.py`) against the forward's
step-by-step path on tiny checkpoints: the logits and every KV cache write equal to the
bit, for quantized weights (GGUF files of two block types, with Qwen2's q/k/v bias) at
1 to `DOT_ROWS` rows and for bfloat16 weights where `small_linear` serves (1 and 2
rows); a row that leaves the batch at a fused layer's checkpoint leaves the others'
logits as they are alone; a step the fused layers do not take (a prefill chunk, more
rows than their kernels) runs step by step. Through the engine, with the fused layers
serving: sequences batched beside cancelled ones decode what they decode alone, and
every block is freed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from kvscope.cache.kv_cache import KVCache
from kvscope.kernels import fused_layer
from kvscope.kernels.attention import block_major_cache, build_metadata, decode_backend
from kvscope.kernels.cpu_decode import compiler, cpu_kernel
from kvscope.kernels.quantized import DOT_ROWS
from kvscope.models.llama import LayerBatch
from kvscope.models.loader import load_model

from .gguf_files import Q, convert_checkpoint
from .test_parity import prompts
from .test_quantized_engine import STEP, beside_cancellations, q41_file  # noqa: F401 (the fixture)

CPU = torch.device("cpu")
BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    if compiler() is None:
        pytest.skip("no C++ compiler here: the fused layer is part of the compiled library")
    assert cpu_kernel().wait(timeout=900), cpu_kernel().why_not
    decode_backend.cache_clear()


class Run:
    """A model's forward driven by hand over its own KV cache: sequences prefilled,
    then decode steps, each sequence's blocks handed out in the same order every run."""

    def __init__(self, loaded: Any, prompts: list[list[int]]) -> None:
        c = loaded.config
        self.model = loaded.model
        self.kv = KVCache(
            num_layers=c.num_layers, num_blocks=128, block_size=BLOCK,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.model.dtype, device=CPU,
            block_major=block_major_cache(CPU),
        )  # fmt: skip
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []
        free = list(range(127, 0, -1))
        for seq, ids in enumerate(prompts):
            self.tables.append([free.pop() for _ in range(-(-(len(ids) + 16) // BLOCK))])
            self.lengths.append(0)
            self.step([(seq, ids)])

    def step(self, chunks: list[tuple[int, list[int]]], checkpoint: Any = None) -> torch.Tensor:
        meta = self.metadata(chunks)
        ids = torch.tensor([t for _, tokens in chunks for t in tokens])
        positions = torch.tensor(
            [self.lengths[seq] + i for seq, tokens in chunks for i in range(len(tokens))]
        )
        for seq, tokens in chunks:
            self.lengths[seq] += len(tokens)
        with torch.inference_mode():
            hidden = self.model.forward(ids, positions, meta, self.kv, checkpoint)
            return self.model.logits(hidden)

    def metadata(self, chunks: list[tuple[int, list[int]]], offset: int = 0) -> Any:
        return build_metadata(
            starts=[self.lengths[seq] - offset for seq, _ in chunks],
            lengths=[len(tokens) for _, tokens in chunks],
            block_tables=[self.tables[seq] for seq, _ in chunks],
            block_size=BLOCK,
            device=CPU,
        )


def quantized_file(checkpoints: Any, tmp_path: Path, kind: str, qtype: Any) -> Path:
    path, _ = convert_checkpoint(
        checkpoints(kind),
        tmp_path / f"{kind}.gguf",
        arch="qwen2" if kind == "qwen2" else "llama",
        qtype_of=lambda name: qtype if name.endswith("proj.weight") else Q.F32,
    )
    return path


def fused_and_stepwise(loaded: Any, ids_list: list[list[int]], rows: int) -> None:
    """Two runs alike but for the fused layers: three decode steps of `rows` sequences
    give equal logits and caches."""
    model = loaded.model
    assert all(layer is not None for layer in model.fused)
    fused_run, step_run = Run(loaded, ids_list), Run(loaded, ids_list)
    layers = model.fused
    for token in (5, 9, 13):
        chunks = [(seq, [token + seq]) for seq in range(rows)]
        meta, hidden = fused_run.metadata(chunks), torch.empty(rows, 1, dtype=model.dtype)
        assert all(fused_layer.choose(layers, meta, hidden, None)), "the step runs fused"
        fused = fused_run.step(chunks)
        model.fused = [None] * len(layers)
        try:
            stepwise = step_run.step(chunks)
        finally:
            model.fused = layers
        assert torch.equal(fused, stepwise)
    for ours, theirs in zip(fused_run.kv.keys + fused_run.kv.values, step_run.kv.keys + step_run.kv.values, strict=True):  # fmt: skip
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=["Q8_0", "Q4_1"])
def test_quantized_layers_equal_the_stepwise_path(
    checkpoints: Any, tmp_path: Path, kind: str, qtype: Any
) -> None:
    loaded = load_model(str(quantized_file(checkpoints, tmp_path, kind, qtype)), device=CPU)
    ids_list = (prompts(checkpoints(kind)) * 2)[:DOT_ROWS]
    for rows in (1, 3, DOT_ROWS):
        fused_and_stepwise(loaded, ids_list[:rows], rows)


def test_bfloat16_layers_equal_the_stepwise_path(checkpoints: Any) -> None:
    if cpu_kernel().small_linear_op is None:
        pytest.skip(f"small_linear serves only on AVX-512 BF16 (this build: {cpu_kernel().isa})")
    loaded = load_model(str(checkpoints("llama")), device=CPU, dtype="bfloat16")
    ids_list = prompts(checkpoints("llama"))
    for rows in (1, 2):
        fused_and_stepwise(loaded, ids_list[:rows], rows)
    meta = Run(loaded, ids_list[:3]).metadata([(0, [1]), (1, [1]), (2, [1])])
    three = torch.empty(3, 1, dtype=torch.bfloat16)
    assert not any(fused_layer.choose(loaded.model.fused, meta, three, None))


def test_prefill_and_too_many_rows_run_step_by_step(checkpoints: Any, tmp_path: Path) -> None:
    loaded = load_model(str(quantized_file(checkpoints, tmp_path, "llama", Q.Q8_0)), device=CPU)
    layers = loaded.model.fused
    run = Run(loaded, prompts(checkpoints("llama"))[:1])
    hidden = torch.empty(1, 1, dtype=loaded.model.dtype)
    prefill = run.metadata(
        [(0, [1, 2, 3])],
    )
    assert not any(fused_layer.choose(layers, prefill, torch.empty(3, 1), None))
    assert all(fused_layer.choose(layers, run.metadata([(0, [1])]), hidden, None))
    wide = torch.empty(DOT_ROWS + 1, 1, dtype=loaded.model.dtype)
    assert not any(layer.takes(DOT_ROWS + 1, prefill, wide) for layer in layers if layer)
    assert not any(fused_layer.choose(layers, prefill, hidden, lambda linears: False))


def test_a_row_leaving_at_a_fused_layer_leaves_the_others_exact(
    checkpoints: Any, tmp_path: Path
) -> None:
    """The forward's checkpoint before layer 1 drops sequence 1 (as the runner drops a
    cancelled sequence's rows): sequences 0 and 2 get the logits they get alone."""
    loaded = load_model(str(quantized_file(checkpoints, tmp_path, "llama", Q.Q4_1)), device=CPU)
    ids_list = prompts(checkpoints("llama"))[:3]
    dropping, alone = Run(loaded, ids_list), Run(loaded, ids_list)
    calls = []

    def checkpoint(batch: LayerBatch | None) -> None:
        if batch is None:
            return
        calls.append(batch.hidden.shape[0])
        if len(calls) == 2:  # before layer 1: layer 0 wrote all three rows' K/V
            keep = torch.tensor([0, 2])
            batch.hidden, batch.cos, batch.sin = (
                t[keep] for t in (batch.hidden, batch.cos, batch.sin)
            )
            batch.meta = dropping.metadata([(0, [7]), (2, [9])], offset=1)

    logits = dropping.step([(0, [7]), (1, [8]), (2, [9])], checkpoint)
    assert calls[:3] == [3, 3, 2] and len(logits) == 2
    assert torch.equal(logits, alone.step([(0, [7]), (2, [9])]))


@pytest.mark.anyio
async def test_cancelled_beside_fused_steps_leave_the_rest_as_alone(
    q41_file: Path,  # noqa: F811 (the fixture)
    checkpoints: Any,
    open_engine: Any,
) -> None:
    """Greedy streams beside two cancelled while they decode, in decode steps of up to
    six rows that the fused layers take, in the model's own thread: each stream's
    tokens are those it decodes alone; `open_engine` checks that no block leaked."""
    ids_list = prompts(checkpoints("llama"))
    options = {**STEP, "worker": "thread"}
    async with open_engine(str(q41_file), **options) as engine:
        model = engine.loaded.model
        assert all(layer is not None for layer in model.fused)
        assert fused_layer.decode_layer_op(model.fused[0]) is not None, "the fused op serves"
        alone = []
        for ids in ids_list:
            out = await engine.generate(ids, temperature=0, max_tokens=12, ignore_eos=True)
            alone.append(list(out.token_ids))
        with anyio.fail_after(120):
            tokens, reasons = await beside_cancellations(engine, ids_list, 12)
    assert reasons == ["cancelled", "cancelled"]
    assert tokens == alone
