"""`LinearSlicer`: a long linear layer in column pieces, with a checkpoint between two
of them, gives the layer's own result, in each layout the layer may have; so does the
gated MLP cut into pieces, with prepacked pieces or (past their memory budget) plain
ones."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvscope.kernels import linear as linear_layouts
from kvscope.kernels import slicing
from kvscope.kernels.fused import silu_and_mul
from kvscope.kernels.linear import Linear, bucket_rows
from kvscope.kernels.slice_ranges import ALIGN, column_ranges, row_ranges
from kvscope.kernels.slicing import LinearSlicer


def planned_linear(dtype: torch.dtype, shape: tuple[int, int] = (1024, 256)) -> Linear:
    generator = torch.Generator().manual_seed(sum(shape))
    layer = Linear((torch.randn(*shape, generator=generator) / shape[1] ** 0.5).to(dtype))
    linear_layouts.plan([layer])
    return layer


def assert_close(out: torch.Tensor, whole: torch.Tensor) -> None:
    assert out.shape == whole.shape and out.dtype == whole.dtype
    tolerance = 1e-5 if out.dtype == torch.float32 else 1e-2
    assert ((out.float() - whole.float()).abs().max() / whole.float().abs().max()) <= tolerance


@pytest.mark.parametrize("layout", ["as this CPU plans it", "float32 copies"])
@pytest.mark.parametrize("rows", [8, 517])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pieces_give_the_layers_result_with_a_checkpoint_between_each(
    rows, dtype, layout, monkeypatch
) -> None:
    """In each layout: bfloat16 prepacked, or (where bfloat16 does not prepack) float32
    copies, themselves prepacked, cut into prepacked pieces; past 64 rows, in row ranges
    too, as many as `cut` says."""
    if layout == "float32 copies":
        monkeypatch.setattr(linear_layouts, "_bf16_prepack_supported", lambda: False)
    layer = planned_linear(dtype)
    slicer = LinearSlicer(target=1e-12)  # as many pieces as the layer allows
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    columns, ranges = slicer.cut(layer, rows)
    assert columns == 1024 // 256
    assert len(ranges) == (1 if rows < 2 * slicing.MIN_ROWS else bucket_rows(rows) // 64)
    calls = []
    with torch.inference_mode():
        out = slicer(layer, x, lambda: calls.append(None))
        whole = layer(x)
    assert len(calls) == columns * len(ranges) - 1
    assert_close(out, whole)


@pytest.mark.parametrize("budget", ["prepacked pieces", "plain pieces"])
@pytest.mark.parametrize("rows", [8, 517])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_gated_mlp_in_pieces_gives_the_layers_result(rows, dtype, budget, monkeypatch) -> None:
    """gate_up's pieces pair each gate column range with the same up range, down's add
    the residual into their own columns: the result is the MLP's, with a checkpoint
    between every two pieces and one between the two layers."""
    if budget == "plain pieces":
        monkeypatch.setattr(slicing, "PACKED_PIECES_BUDGET", 0)
    gate_up = planned_linear(dtype, (2 * 768, 256))
    down = planned_linear(dtype, (512, 768))
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=generator).to(dtype)
    residual = torch.randn(rows, 512, generator=generator).to(dtype)
    slicer = LinearSlicer(target=1e-12)
    (first, first_ranges), (second, second_ranges) = (
        slicer.cut(gate_up, rows),
        slicer.cut(down, rows),
    )
    expected_calls = first * len(first_ranges) + second * len(second_ranges) - 1
    assert first == 6 and second == 2
    calls = []
    with torch.inference_mode():
        out = slicer.gated_mlp(gate_up, down, x, residual, lambda: calls.append(None))
        whole = residual + down(silu_and_mul(gate_up(x)))
        unsliced = slicer.gated_mlp(gate_up, down, x, residual, None)
    assert len(calls) == expected_calls
    assert_close(out, whole)
    assert torch.equal(unsliced, whole)  # no checkpoint hook: no pieces


@pytest.mark.parametrize("layout", ["as this CPU plans it", "float32 copies"])
def test_the_gated_mlp_in_pieces_holds_step_after_step(layout, monkeypatch) -> None:
    """Each step cuts the MLP again from the pieces the first one made: gate_up's paired
    pieces and its plain column pieces are different cuts of one layer, and neither is
    taken for the other. (On a CPU without bfloat16 prepacking, gate_up multiplies in
    float32 copies; its second step once took those for paired pieces and failed.)"""
    if layout == "float32 copies":
        monkeypatch.setattr(linear_layouts, "_bf16_prepack_supported", lambda: False)
    gate_up = planned_linear(torch.bfloat16, (2 * 768, 256))
    down = planned_linear(torch.bfloat16, (512, 768))
    if layout == "float32 copies":
        assert gate_up.layout().startswith("wide")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8, 256, generator=generator).to(torch.bfloat16)
    residual = torch.randn(8, 512, generator=generator).to(torch.bfloat16)
    slicer = LinearSlicer(target=1e-12)
    with torch.inference_mode():
        whole = residual + down(silu_and_mul(gate_up(x)))
        for _step in range(3):
            assert_close(slicer.gated_mlp(gate_up, down, x, residual, lambda: None), whole)


def test_forget_lets_the_cut_layers_go() -> None:
    """Once its model released its weights, the slicer holds neither the layers it cut
    nor their pieces (`ModelRunner.release_model` calls `forget`)."""
    slicer = LinearSlicer(target=1e-12)
    layer = planned_linear(torch.bfloat16)
    with torch.inference_mode():
        slicer(layer, torch.randn(8, 256).to(torch.bfloat16), lambda: None)
    gone = weakref.ref(layer.weight)
    del layer
    gc.collect()
    assert gone() is not None  # the pieces still hold it
    slicer.forget()
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("size", [1408, 2816, 512, 1000])
@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 7])
def test_pieces_are_cut_on_aligned_columns_where_each_can_have_some(size, pieces) -> None:
    """Every cut falls on a multiple of ALIGN (oneDNN's speed depends on it), the
    ranges cover the columns in order, and their widths differ by at most one unit."""
    ranges = column_ranges(size, pieces)
    assert len(ranges) == pieces
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    cuts = [start for start, _ in ranges[1:]]
    assert all(cut % ALIGN == 0 for cut in cuts)
    widths = [end - start for start, end in ranges]
    assert min(widths) > 0
    assert max(widths[:-1], default=0) - min(widths[:-1], default=0) <= ALIGN


def test_too_few_columns_for_aligned_pieces_are_cut_evenly() -> None:
    ranges = column_ranges(3 * ALIGN - 1, 4)
    widths = [end - start for start, end in ranges]
    assert sum(widths) == 3 * ALIGN - 1 and max(widths) - min(widths) <= 1


@pytest.mark.parametrize("rows", [1, 17, 64, 250, 257, 517, 1500, 1536])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_row_ranges_run_at_the_buckets_of_their_rows_bucket(rows, parts) -> None:
    """The ranges cover the rows in order, and each multiplies at the rows of the same
    range of the rows' bucket (the warm-up's step of that bucket, whose kernels are
    built), which are its own rows but for the last one's."""
    ranges = row_ranges(rows, parts)
    padded = row_ranges(bucket_rows(rows), parts)
    assert ranges[0].rows.start == 0 and ranges[-1].rows.stop == rows
    assert all(a.rows.stop == b.rows.start for a, b in zip(ranges, ranges[1:], strict=False))
    assert len(ranges) == len(padded) <= parts
    for mine, its in zip(ranges, padded, strict=True):
        assert mine.rows.start == its.rows.start and mine.at == its.at
        assert its.at == its.rows.stop - its.rows.start == bucket_rows(its.at)
        assert 0 < mine.rows.stop - mine.rows.start <= mine.at


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K"])
def test_a_quantized_layer_in_pieces_gives_its_whole_result(qtype: str) -> None:
    """A weight kept in GGML blocks is cut into row views of its blocks (no copy, no
    dequantized float copy), each multiplied as the whole layer multiplies: the same
    result to the bit, with a checkpoint between two pieces; the gated MLP too."""
    from kvscope.kernels.ggml_quants import random_blocks
    from kvscope.kernels.quantized import QuantizedWeight

    generator = torch.Generator().manual_seed(3)

    def quantized(rows: int, columns: int) -> Linear:
        data = random_blocks(qtype, rows, columns, generator)
        return Linear(
            QuantizedWeight(qtype, (rows, columns), data), activation_dtype=torch.bfloat16
        )

    layer, down = quantized(1024, 256), quantized(256, 512)
    linear_layouts.plan([layer, down])
    assert layer.layout() == f"quantized-{qtype}" and layer.wide is None and layer.packed is None
    slicer = LinearSlicer(target=1e-12)
    x = torch.randn(8, 256, generator=generator).to(torch.bfloat16)
    assert slicer.cut(layer, 8)[0] == 1024 // 256
    calls: list[None] = []
    with torch.inference_mode():
        out = slicer(layer, x, lambda: calls.append(None))
        whole = layer(x)
        mlp = slicer.gated_mlp(layer, down, x, x, lambda: calls.append(None))
        mlp_whole = x + down(silu_and_mul(layer(x)))
    assert len(calls) >= 2 * (1024 // 256) - 1
    assert torch.equal(out, whole)
    assert torch.equal(mlp, mlp_whole)


def test_a_layer_fits_the_gap_by_its_own_rows_not_their_bucket() -> None:
    """Whether a fused layer fits one checkpoint gap is judged at the rows it
    multiplies: at one row, a gap just over the layers' one-row cost admits them
    (at the 16 rows of the bucket they would not fit), and one just under does not."""
    layers = [planned_linear(torch.bfloat16, shape) for shape in [(1024, 256), (256, 512)]]
    slicer = LinearSlicer(target=1.0)
    costs = [slicer.cost(layer) for layer in layers]
    one_row = sum(a + b for a, b in costs)
    assert sum(a + b * bucket_rows(1) for a, b in costs) > one_row * 1.01, "the bucket pads"
    slicer.target = one_row * 1.01
    assert slicer.within_target(layers, 1)
    slicer.target = one_row * 0.99
    assert not slicer.within_target(layers, 1)
