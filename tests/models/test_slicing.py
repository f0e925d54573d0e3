"""`LinearSlicer`: a long linear layer in column pieces, with a checkpoint between two
of them, gives the layer's own result, in each layout the layer may have."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import linear as linear_layouts
from kvscope.kernels.linear import Linear
from kvscope.models.slicing import LinearSlicer


def planned_linear(dtype: torch.dtype) -> Linear:
    generator = torch.Generator().manual_seed(0)
    layer = Linear(torch.randn(1024, 256, generator=generator).to(dtype))
    linear_layouts.plan([layer])
    return layer


@pytest.mark.parametrize("rows", [8, 517])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pieces_give_the_layers_result_with_a_checkpoint_between_each(rows, dtype) -> None:
    layer = planned_linear(dtype)
    slicer = LinearSlicer(target=1e-12)  # as many pieces as the layer allows
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    pieces = slicer.pieces(layer, rows)
    assert pieces == 1024 // 256
    calls = []
    with torch.inference_mode():
        out = slicer(layer, x, lambda: calls.append(None))
        whole = layer(x)
    assert len(calls) == pieces - 1
    assert out.shape == whole.shape and out.dtype == whole.dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.float() - whole.float()).abs().max() / whole.float().abs().max()) <= tolerance
