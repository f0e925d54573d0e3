"""The fused elementwise steps (`kernels/fused.py`, `csrc/elementwise.cpp`) against
torch's unfused ops: the same values in float32 to rounding, bfloat16 off by a rounding
in a rare element; rows of odd widths and strided rows; torch's ops wherever the compiled ones
do not apply."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import fused
from kvscope.kernels.cpu_decode import cpu_kernel

# Widths: the reference model's (512 and 2 x 1408), and one the vector path does not
# divide (74), so each row's tail goes through the scalar loop.
WIDTHS = [74, 512, 2816]


@pytest.fixture(scope="module")
def loaded(cpu_library):
    assert cpu_library.rms_norm_op is not None and cpu_library.silu_and_mul_op is not None
    return cpu_library


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    differ = (out != ref).sum().item()
    assert differ <= max(1, out.numel() // 10_000), f"{differ} of {out.numel()} differ"
    # One bfloat16 step of an intermediate (the normed row, before the weight scales it)
    # is at most two of the result.
    steps = (ref.float().abs() * 2**-6).clamp_min(1e-30)
    assert ((out.float() - ref.float()).abs() <= steps).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_steps_give_torchs_results(loaded, dtype, width, rows) -> None:
    generator = torch.Generator().manual_seed(rows * width)
    x = (3 * torch.randn(rows, width, generator=generator)).to(dtype)
    weight = (torch.rand(width, generator=generator) + 0.5).to(dtype)
    close(fused.rms_norm(x, weight, 1e-6), fused.torch_rms_norm(x, weight, 1e-6))
    close(fused.silu_and_mul(x), fused.torch_silu_and_mul(x))


def test_strided_rows_and_a_tensor_of_heads(loaded) -> None:
    """Rows sliced out of a wider matrix are read in place; a [tokens, heads, dim]
    tensor (Qwen3's q/k norms) takes torch's path with the same result."""
    wide = torch.randn(9, 3000).to(torch.bfloat16)
    x = wide[:, :2816]
    assert not x.is_contiguous()
    close(fused.silu_and_mul(x), fused.torch_silu_and_mul(x))
    weight = torch.rand(2816).to(torch.bfloat16) + 0.5
    close(fused.rms_norm(x, weight, 1e-5), fused.torch_rms_norm(x, weight, 1e-5))
    heads = torch.randn(5, 4, 64).to(torch.bfloat16)
    head_weight = torch.rand(64).to(torch.bfloat16)
    assert torch.equal(
        fused.rms_norm(heads, head_weight, 1e-6), fused.torch_rms_norm(heads, head_weight, 1e-6)
    )


def test_without_the_library_the_steps_are_torchs(loaded, monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernel(), "rms_norm_op", None)
    monkeypatch.setattr(cpu_kernel(), "silu_and_mul_op", None)
    x = torch.randn(6, 128).to(torch.bfloat16)
    weight = torch.rand(128).to(torch.bfloat16)
    assert torch.equal(fused.rms_norm(x, weight, 1e-6), fused.torch_rms_norm(x, weight, 1e-6))
    assert torch.equal(fused.silu_and_mul(x), fused.torch_silu_and_mul(x))


def test_the_ops_refuse_what_they_cannot_read(loaded) -> None:
    x = torch.randn(4, 10)
    with pytest.raises(RuntimeError, match="wrong shape"):
        loaded.silu_and_mul_op(torch.empty(4, 4), x)
    with pytest.raises(RuntimeError, match="weight"):
        loaded.rms_norm_op(torch.empty_like(x), x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        loaded.silu_and_mul_op(torch.empty(4, 5, dtype=torch.float64), x.double())
