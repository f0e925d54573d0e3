"""Quantized weights as GGUF files hold them, kept quantized in memory and multiplied so.

`QuantizedWeight` is the one type that crosses from the model files (`models/gguf*.py`,
which read a GGUF tensor and build one) to the kernels that multiply it: the GGML block
type by name (`"Q4_1"`, `"Q8_0"`, `"Q4_K"`, ...), the logical shape `(out_features,
in_features)` as a linear layer sees it, and the raw blocks, one row of the weight per
row of `data` (each row is quantized on its own, so a row range is a view and a row
permutation is a row gather, whatever the type).

`quantized_linear(x, weight, bias)` is `x W^T + b` without a float copy of `W`:

* few rows (a decode step, up to `DOT_ROWS`): the compiled library's `quant_linear`
  (`csrc/quant_matmul.cpp`) quantizes each row of `x` to 8 bits a group of 32 and
  takes integer dot products with the weight's codes (AVX-512 VNNI or AVX2), reading
  each weight byte once;
* more rows (prefill): `SLAB_VALUES` weight values at a time are dequantized to `x`'s
  dtype (the library's `quant_dequantize`, ~0.2 ns a value) and multiplied by
  `F.linear` (oneDNN);
* without the library (no compiler, a failed build or check, another device, a type it
  lacks): the same slabs dequantized in torch (`ggml_quants.dequantize_rows`). Each
  call dequantizes again, 1.2-2.7 ns a value on one thread (~0.3 s a decode step of
  SmolLM2-135M): slow, but no float copy of the weight is kept, which would cost the
  float model's memory the quantized file saves.

Measured with `python -m kvscope.bench.quant_matmul --threads 1` on the 2-core AMD EPYC
dev machine (AVX-512 VNNI/BF16), SmolLM2-135M's shapes in Q4_1 (lm_head in Q8_0),
weights cycled through 256 MiB of copies so that they come from memory as in a decode
step (two threads there were too disturbed by the other tenants to time). At one row
the dot kernel took 0.050 / 0.033 / 0.140 / 0.068 / 2.63 ms (qkv, o, gate_up, down,
lm_head) against bfloat16 `small_linear`'s 0.062 / 0.059 / 0.249 / 0.178 / 5.23 and
`F.linear`'s 0.20 / 0.14 / 0.57 / 0.25 / 8.6: 1.2-2.6x and 3.3-4.2x quicker (another
run: 1.5-2.3x and 2-5x). The kernel itself is compute-bound, ~1.8 ns a group of 32
(~11 GB/s of Q4_1 a thread, from cache or memory alike); a call costs ~10 us more. Each
added row costs nearly a row's time, so at 8 rows it still won (qkv 0.20 against the
slabs' 0.25 ms; lm_head 8.3 against 12.0), at 16 the slabs won or tied (0.31 against
0.37; 14.5 against 17.4), hence `DOT_ROWS`. From 16 rows the slabs take 0.7-1.6x the
time of bfloat16 `F.linear` (the dequantization, one oneDNN call a slab).

Q4_1 on AVX-512 now takes four blocks an iteration (`csrc/quant_quads.h`). With two
threads, one row, weights from memory (`--threads 2`, same machine, busy, the better of
two interleaved runs each): qkv 0.023 -> 0.020, o 0.044 -> 0.013-0.018, gate_up 0.058 ->
0.054-0.058, down 0.030-0.032 -> 0.033 ms: at one row both read memory at 15-21 GB/s, so
little changes; at 4 rows 1.2-1.3x (gate_up 0.119 -> 0.097-0.108 ms), at 8 rows
1.2-1.4x. One thread, one row: 1.15-1.4x from memory, 1.4-1.7x from cache. A decode step
of SmolLM2-135M Q4_1 through `Engine.generate`, two threads: 12.6-13.3 ms -> 10.6-11.0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

from .cpu_decode import cpu_kernel
from .ggml_quants import BLOCKS, COMPILED_TYPES, SUPPORTED_TYPES, dequantize_rows

__all__ = [
    "COMPILED_TYPES",
    "SUPPORTED_TYPES",
    "QuantizedWeight",
    "compiled_for",
    "concat_rows",
    "dequantize",
    "dot_linear",
    "quantized_linear",
    "slab_linear",
]

#: Up to this many rows the integer dot-product kernel serves; above, dequantized slabs
#: and `F.linear` (measured: see the module's docstring).
DOT_ROWS = 8
#: Weight values a dequantized slab holds (2 MiB in bfloat16): a quarter of this was
#: slower (more oneDNN calls), four times it no quicker.
SLAB_VALUES = 1 << 20
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


@attrs.frozen
class QuantizedWeight:
    """A `(out_features, in_features)` weight in GGML blocks: `data` is uint8,
    `(out_features, row_bytes)`, contiguous, each row the blocks of one output feature."""

    qtype: str
    shape: tuple[int, int]
    data: torch.Tensor

    def __attrs_post_init__(self) -> None:
        if self.qtype not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGML type {self.qtype!r} is not supported (supported: {sorted(SUPPORTED_TYPES)})"
            )
        out_features, in_features = self.shape
        block = BLOCKS[self.qtype]
        if in_features % block.elems:
            raise ValueError(
                f"{self.qtype} rows hold blocks of {block.elems} values; "
                f"in_features {in_features} is not a multiple"
            )
        expected = (out_features, in_features // block.elems * block.nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"{self.qtype} weight of shape {self.shape} needs uint8 data of shape "
                f"{expected}, got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if not self.data.is_contiguous():
            raise ValueError("a quantized weight's data must be contiguous")

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def rows(self, lo: int, hi: int) -> QuantizedWeight:
        """Output rows `lo` to `hi` (exclusive), a view of the same blocks."""
        if not 0 <= lo <= hi <= self.out_features:
            raise ValueError(f"rows {lo}:{hi} out of range for {self.out_features} rows")
        return QuantizedWeight(self.qtype, (hi - lo, self.in_features), self.data[lo:hi])


def concat_rows(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The weights' rows in turn, as one weight (fused q/k/v or gate/up): one type and
    one `in_features` for all; a copy of their blocks."""
    if not weights:
        raise ValueError("concat_rows needs at least one weight")
    first = weights[0]
    for weight in weights[1:]:
        if (weight.qtype, weight.in_features) != (first.qtype, first.in_features):
            raise ValueError(
                f"cannot stack a {weight.qtype} weight of {weight.in_features} columns onto "
                f"{first.qtype} of {first.in_features}"
            )
    rows = sum(weight.out_features for weight in weights)
    data = torch.cat([weight.data for weight in weights])
    return QuantizedWeight(first.qtype, (rows, first.in_features), data)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a `(out_features, in_features)` tensor of `dtype`, equal to what
    `gguf.quants.dequantize` gives (computed in float32, then cast)."""
    return dequantize_rows(weight.qtype, weight.data, weight.in_features, dtype)


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x W^T + b` for `x` of shape (..., in_features), in `x`'s dtype."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"input has {x.shape[-1]} features; the weight takes {weight.in_features}")
    if not x.is_floating_point():
        raise ValueError(f"quantized_linear takes float inputs, got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.out_features,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} for {weight.out_features} outputs")
    if x.dim() == 2:
        return _linear_2d(x, weight, bias)
    y = _linear_2d(x.reshape(-1, weight.in_features), weight, bias)
    return y.view(*x.shape[:-1], weight.out_features)


def _linear_2d(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if not compiled_for(x, weight):
        return slab_linear(x, weight, bias, compiled=False)
    if x.shape[0] <= DOT_ROWS:
        return dot_linear(x, weight, bias)
    return slab_linear(x, weight, bias, compiled=True)


def compiled_for(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether the compiled library multiplies `x` by `weight` (starting its build, or
    its load from the cache, on the first call)."""
    kernel = cpu_kernel()
    if kernel.quant_linear_op is None:
        kernel.start()  # idempotent, but takes a lock: not on every call once loaded
        return False
    return (
        x.device.type == "cpu"
        and weight.data.device.type == "cpu"
        and x.dtype in ACTIVATION_DTYPES
        and weight.qtype in COMPILED_TYPES
    )


def dot_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The compiled integer dot-product kernel (see `compiled_for`): x (rows, in) of
    float32 or bfloat16, bias (if any) of x's dtype."""
    op = cpu_kernel().quant_linear_op
    assert op is not None, "see compiled_for"
    out = x.new_empty(x.shape[0], weight.out_features)
    bias = None if bias is None else bias.contiguous()
    op(out, x.contiguous(), weight.data, weight.qtype, weight.in_features, bias)
    return out


def slab_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    *,
    compiled: bool,
    slab_values: int | None = None,
) -> torch.Tensor:
    """`x W^T + b` through slabs of `W` (`slab_values` values each, else the default)
    dequantized to x's dtype: by the compiled library (`compiled`, see `compiled_for`)
    or by torch."""
    if not compiled:
        return _by_slabs(x, weight, bias, dequantize, slab_values or SLAB_VALUES)
    op = cpu_kernel().quant_dequantize_op
    assert op is not None, "see compiled_for"

    def compiled_dequantize(part: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        values = torch.empty(part.shape, dtype=dtype)
        op(values, part.data, part.qtype)
        return values

    return _by_slabs(x, weight, bias, compiled_dequantize, slab_values or SLAB_VALUES)


def _by_slabs(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    dequantize_part: Callable[[QuantizedWeight, torch.dtype], torch.Tensor],
    slab_values: int,
) -> torch.Tensor:
    """`x W^T + b` a slab of output rows at a time, each slab dequantized to `x`'s dtype
    and multiplied by `F.linear`; one slab when the weight fits in one."""
    step = max(1, slab_values // weight.in_features)
    if step >= weight.out_features:
        return F.linear(x, dequantize_part(weight, x.dtype), bias)
    out = x.new_empty(x.shape[0], weight.out_features)
    for lo in range(0, weight.out_features, step):
        hi = min(lo + step, weight.out_features)
        part_bias = None if bias is None else bias[lo:hi]
        out[:, lo:hi] = F.linear(x, dequantize_part(weight.rows(lo, hi), x.dtype), part_bias)
    return out
