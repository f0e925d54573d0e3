"""The fused elementwise steps (`kernels/fused.py`, `csrc/elementwise.cpp`) against
torch's unfused ops: the same values in float32 to rounding, bfloat16 off by a rounding
in a rare element (the rotary embedding and cache write: bit for bit); rows of odd
widths and strided rows; torch's ops wherever the compiled ones do not apply."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import fused
from kvscope.kernels.attention import write_slots
from kvscope.kernels.cpu_decode import cpu_kernel
from kvscope.kernels.linear import Linear, plan
from kvscope.kernels.rope import apply_rotary, rotary_tables

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


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_silu_and_mul_writes_into_columns_of_a_wider_matrix(loaded, monkeypatch, compiled):
    """`out` may be a column range of a wider matrix (the sliced MLP writes each piece's
    activation so); the columns beside it are left alone."""
    if not compiled:
        monkeypatch.setattr(cpu_kernel(), "silu_and_mul_op", None)
    x = torch.randn(33, 2 * 300).to(torch.bfloat16)
    wide = torch.full((33, 1000), 7.0, dtype=torch.bfloat16)
    out = wide[:, 200:500]
    assert fused.silu_and_mul(x, out) is out
    close(out.clone(), fused.torch_silu_and_mul(x))
    assert (wide[:, :200] == 7).all() and (wide[:, 500:] == 7).all()


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


def rope_inputs(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """A fused qkv matrix's q+k and v views (rows strided, as the model's are), the
    rotary tables at positions spread over a long context, distinct slots."""
    generator = torch.Generator().manual_seed(seed)
    width = (heads + kv_heads) * dim
    qkv = (3 * torch.randn(tokens, width + 7, generator=generator)).to(dtype)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    v = qkv[:, heads * dim : width].view(tokens, kv_heads, dim)
    cos, sin = rotary_tables(dim, 10_000.0, None, 4096, torch.device("cpu"))
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    slots = torch.randperm(64 * 16, generator=generator)[:tokens]
    return qkv, qk, v, cos[positions].to(dtype), sin[positions].to(dtype), slots


def empty_caches(kv_heads: int, dim: int, dtype: torch.dtype, *, head_major: bool):
    def one() -> torch.Tensor:
        if head_major:  # KVCache's CPU layout: a [blocks, slots, heads, dim] view
            return torch.zeros(kv_heads, 64, 16, dim, dtype=dtype).permute(1, 2, 0, 3)
        return torch.zeros(64, 16, kv_heads, dim, dtype=dtype)

    return one(), one()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "block-major"])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"),
    [(1, 8, 4, 64), (33, 8, 4, 64), (300, 12, 2, 128), (5, 6, 3, 80), (3, 2, 1, 6)],
)
def test_rope_and_cache_is_apply_rotary_then_write_slots(
    loaded, dtype, head_major, tokens, heads, kv_heads, dim
) -> None:
    """The rotated q and k heads and the cache they land in are torch's: bit for bit
    in bfloat16 (every product is exact in float32 and rounded where torch rounds), to
    float32 rounding in float32; nothing but the given slots is written."""
    qkv, qk, v, cos, sin, slots = rope_inputs(tokens, heads + kv_heads, kv_heads, dim, dtype, dim)
    untouched = qkv[:, -7:].clone()
    expected = apply_rotary(qk.clone(), cos, sin)
    ref_keys, ref_values = empty_caches(kv_heads, dim, dtype, head_major=head_major)
    write_slots(ref_keys, slots, expected[:, heads:])
    write_slots(ref_values, slots, v)
    keys, values = empty_caches(kv_heads, dim, dtype, head_major=head_major)

    assert fused.rope_and_cache(qk, v, cos, sin, slots, keys, values)

    if dtype == torch.bfloat16:
        assert torch.equal(qk, expected)
        assert torch.equal(keys, ref_keys)
    else:
        torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(keys, ref_keys, rtol=1e-6, atol=1e-6)
    assert torch.equal(values, ref_values)
    assert torch.equal(qkv[:, -7:], untouched)


def test_rope_and_cache_falls_back_where_it_does_not_apply(loaded, monkeypatch) -> None:
    """False, with nothing written, for what the op cannot read (the caller then uses
    torch's ops); and without the library at all."""
    dtype = torch.bfloat16
    _, qk, v, cos, sin, slots = rope_inputs(4, 6, 2, 64, dtype, 1)
    keys, values = empty_caches(2, 64, dtype, head_major=True)
    before = qk.clone()
    assert not fused.rope_and_cache(qk, v, cos.float(), sin.float(), slots, keys, values)
    assert not fused.rope_and_cache(qk, v, cos, sin, slots.int(), keys, values)
    assert not fused.rope_and_cache(qk.half(), v.half(), cos, sin, slots, keys, values)
    heads_apart = torch.randn(4, 64, 6).to(dtype).transpose(1, 2)  # dim not contiguous
    assert not fused.rope_and_cache(heads_apart, v, cos, sin, slots, keys, values)
    monkeypatch.setattr(cpu_kernel(), "rope_and_cache_op", None)
    assert not fused.rope_and_cache(qk, v, cos, sin, slots, keys, values)
    assert torch.equal(qk, before)
    assert not keys.any() and not values.any()


def test_rope_and_cache_refuses_a_slot_outside_the_cache(loaded) -> None:
    dtype = torch.bfloat16
    _, qk, v, cos, sin, slots = rope_inputs(4, 6, 2, 64, dtype, 2)
    keys, values = empty_caches(2, 64, dtype, head_major=True)
    slots[2] = 64 * 16  # one past the last slot
    with pytest.raises(RuntimeError, match="outside the cache"):
        loaded.rope_and_cache_op(qk, v, cos, sin, slots, keys, values)
    with pytest.raises(RuntimeError, match="qk's dtype"):
        loaded.rope_and_cache_op(qk, v.float(), cos, sin, slots.clamp_max(5), keys, values)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shape", [(2816, 512), (512, 1408), (70, 40)], ids=str)
@pytest.mark.parametrize("biased", [False, True], ids=["no bias", "bias"])
def test_small_linear_is_f_linear(loaded, rows, shape, biased) -> None:
    """One or two bfloat16 rows against the reference model's widths and one the vector
    path does not divide (40): F.linear's values, off by a bfloat16 rounding in a rare
    element (float32 sums in another order)."""
    generator = torch.Generator().manual_seed(rows)
    n, k = shape
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if biased else None
    out = x.new_empty(rows, n)
    torch.ops.kvscope.small_linear(out, x, weight, bias)
    ref = torch.nn.functional.linear(x, weight, bias)
    assert (out != ref).sum().item() <= max(1, out.numel() // 100)
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()


def test_small_linear_serves_the_bfloat16_linears_of_one_or_two_rows(loaded, monkeypatch):
    """Where the CPU has AVX-512 BF16, a prepacked linear of one or two rows goes through
    `small_linear` (its result, not oneDNN's), and of three rows through oneDNN."""
    if loaded.small_linear_op is None:
        pytest.skip(f"no AVX-512 BF16 vector path here ({loaded.isa})")
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    layer = Linear(weight)
    if plan([layer]) != "prepacked":
        pytest.skip("oneDNN does not prepack bfloat16 here")
    calls: list[int] = []
    real = loaded.small_linear_op
    monkeypatch.setattr(
        loaded,
        "small_linear_op",
        lambda out, x, w, b: calls.append(x.shape[0]) or real(out, x, w, b),
    )
    for rows in (1, 2, 3):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.allclose(layer(x).float(), x.float() @ weight.float().T, rtol=2e-2, atol=2e-2)
    assert calls == [1, 2]


def test_small_linear_refuses_what_it_cannot_read(loaded) -> None:
    """Three rows, or another dtype, are refused with a reason (the Python side never
    sends them)."""
    x, weight = torch.randn(3, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    with pytest.raises(RuntimeError, match="1 or 2 rows"):
        torch.ops.kvscope.small_linear(x.new_empty(3, 8), x, weight, None)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        torch.ops.kvscope.small_linear(torch.empty(1, 8), x[:1].float(), weight.float(), None)
