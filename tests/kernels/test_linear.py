"""Linear layers: each fast weight layout agrees with `F.linear` on the rows that use
it, and a layout that fails the start-up check falls back to `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvscope.kernels import linear
from kvscope.kernels.linear import PACKED_WIDE_ROWS, WIDE_ROWS, Linear, plan


def linears(dtype: torch.dtype, bias: bool = True) -> list[Linear]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for rows, cols in ((96, 64), (40, 96)):
        weight = torch.randn(rows, cols, generator=generator).to(dtype)
        b = torch.randn(rows, generator=generator).to(dtype) if bias else None
        out.append(Linear(weight, b))
    return out


FAST_LAYOUTS = ("wide-prepacked", "wide", "prepacked")


@pytest.mark.parametrize(
    "rows", [1, PACKED_WIDE_ROWS - 1, PACKED_WIDE_ROWS, WIDE_ROWS - 1, WIDE_ROWS, 33]
)
def test_bfloat16_layouts_match_f_linear(rows: int) -> None:
    layers = linears(torch.bfloat16)
    assert plan(layers) in FAST_LAYOUTS
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    layer = layers[0]
    ours, ref = layer(x), F.linear(x, layer.weight, layer.bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
    # Both accumulate in float32; they differ by at most bfloat16 rounding.
    assert torch.allclose(ours.float(), ref.float(), rtol=1e-2, atol=2e-2)


def test_float32_stays_on_f_linear() -> None:
    layers = linears(torch.float32)
    assert plan(layers) == "F.linear"
    assert all(layer.layout() == "plain" for layer in layers)
    x = torch.randn(7, 64)
    assert torch.equal(layers[0](x), F.linear(x, layers[0].weight, layers[0].bias))


def test_a_layout_that_fails_the_check_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(linear.TOLERANCE, torch.bfloat16, -1.0)  # nothing passes
    layers = linears(torch.bfloat16, bias=False)
    assert plan(layers) == "plain"
    assert "differs from F.linear" in caplog.text
    x = torch.randn(9, 64).to(torch.bfloat16)
    assert torch.equal(layers[0](x), F.linear(x, layers[0].weight))


def test_the_float32_copies_respect_their_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "WIDE_COPY_BUDGET", 0)
    monkeypatch.setattr(linear, "_bf16_prepack_supported", lambda: False)
    assert plan(linears(torch.bfloat16)) == "plain"


def test_without_float32_prepacking_the_plain_copy_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "_bf16_prepack_supported", lambda: False)
    monkeypatch.setattr(linear, "_float32_prepack_supported", lambda: False)
    layers = linears(torch.bfloat16)
    assert plan(layers) == "wide"
    x = torch.randn(WIDE_ROWS, 64).to(torch.bfloat16)
    expected = F.linear(x.float(), layers[0].weight.float(), layers[0].bias.float())
    assert torch.equal(layers[0](x), expected.to(torch.bfloat16))


def test_the_prepacked_copy_is_the_first_to_go_over_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(linear, "_bf16_prepack_supported", lambda: False)
    layers = linears(torch.bfloat16)
    float32_bytes = sum(layer.weight.numel() for layer in layers) * 4
    monkeypatch.setattr(linear, "WIDE_COPY_BUDGET", float32_bytes)  # room for one copy
    assert plan(layers) == "wide"
    assert all(layer.wide_packed is None and layer.wide is not None for layer in layers)


@pytest.mark.skipif(
    not linear._float32_prepack_supported(), reason="oneDNN cannot prepack float32 here"
)
def test_a_failing_prepacked_copy_falls_back_to_the_plain_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A prepacked float32 copy that computes the wrong thing (here: packed from twice
    the weight) fails its check at load; the plain float32 copy is then checked on its
    own and serves, with the right result."""
    monkeypatch.setattr(linear, "_bf16_prepack_supported", lambda: False)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(
        torch.ops.mkldnn, "_reorder_linear_weight", lambda weight, *a: reorder(weight * 2, *a)
    )
    layers = linears(torch.bfloat16)
    assert plan(layers) == "wide"
    assert "a wide-prepacked linear layer differs from F.linear" in caplog.text
    x = torch.randn(WIDE_ROWS, 64).to(torch.bfloat16)
    expected = F.linear(x.float(), layers[0].weight.float(), layers[0].bias.float())
    assert torch.equal(layers[0](x), expected.to(torch.bfloat16))


def test_row_buckets_cover_every_row_count_with_few_shapes() -> None:
    """Every row count runs at a bucket at least as large, one of `row_buckets`: a few
    dozen shapes for oneDNN to build instead of one a row count."""
    up_to = 1_536
    buckets = linear.row_buckets(up_to)
    assert buckets == sorted(set(buckets)) and len(buckets) < 40
    for rows in range(1, up_to + 1):
        bucket = linear.bucket_rows(rows)
        assert bucket >= rows and bucket in buckets
        step = linear.BUCKET_SMALL if rows <= linear.BUCKET_SMALL_UNTIL else linear.BUCKET_LARGE
        assert bucket - rows < step  # padded by less than one step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [3, 17, 257, 300])
def test_a_prepacked_multiply_pads_its_rows_and_keeps_the_real_ones(
    dtype: torch.dtype, rows: int
) -> None:
    """Rows padded up to a bucket change nothing: the output has the input's rows, they
    match `F.linear`, and each equals the same row multiplied beside other rows (zeros
    or not) in the same bucket."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    try:
        packed = linear.reorder(weight)
    except RuntimeError as exc:  # no oneDNN prepacking for this dtype on this CPU
        pytest.skip(f"oneDNN cannot prepack {dtype}: {exc}")
    bucket = linear.bucket_rows(rows)
    assert bucket > rows
    full = torch.randn(bucket, 64, generator=generator).to(dtype)
    x = full[:rows]
    ours = linear.prepacked(x, packed, bias)
    assert ours.shape == (rows, 96) and ours.is_contiguous()
    ref = F.linear(x.float(), weight.float(), bias.float())
    assert torch.allclose(ours.float(), ref, rtol=2e-2, atol=5e-2)
    assert torch.equal(ours, linear.prepacked(full, packed, bias)[:rows])
    # Without room in its storage, the rows are copied and padded with zeros: the same.
    assert torch.equal(linear.prepacked(x.clone(), packed, bias), ours)


def test_an_activation_with_bucket_room_is_a_view_of_zero_padded_rows() -> None:
    """`empty_with_bucket_room` gives the asked shape, contiguous, over a storage of
    `bucket_rows` rows whose extra rows are zero; off the CPU, no room is added."""
    cpu = torch.device("cpu")
    x = linear.empty_with_bucket_room(17, 4, 8, dtype=torch.bfloat16, device=cpu)
    assert x.shape == (17, 4, 8) and x.is_contiguous()
    padded = linear.bucket_rows(17)
    assert x.untyped_storage().nbytes() == padded * 4 * 8 * x.element_size()
    whole = x.as_strided((padded, 4, 8), x.stride())
    assert not whole[17:].any()
    exact = linear.empty_with_bucket_room(32, 8, dtype=torch.float32, device=cpu)
    assert exact.untyped_storage().nbytes() == 32 * 8 * 4
    meta = linear.empty_with_bucket_room(17, 8, dtype=torch.float32, device=torch.device("meta"))
    assert meta.shape == (17, 8)


def test_the_fused_ops_write_activations_with_bucket_room() -> None:
    """`rms_norm` and `silu_and_mul` (the inputs of the linears) allocate their outputs
    with room for their bucket's rows, so the linear after them copies nothing."""
    from kvscope.kernels import fused
    from kvscope.kernels.cpu_decode import cpu_kernel

    kernel = cpu_kernel()
    if not kernel.wait(600) or kernel.rms_norm_op is None or kernel.silu_and_mul_op is None:
        pytest.skip("no compiled library on this machine")
    rows = 17
    x = torch.randn(rows, 64).to(torch.bfloat16)
    room = linear.bucket_rows(rows)
    normed = fused.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    activated = fused.silu_and_mul(torch.randn(rows, 128).to(torch.bfloat16))
    for out in (normed, activated):
        assert out.untyped_storage().nbytes() >= room * out.shape[1] * out.element_size()
