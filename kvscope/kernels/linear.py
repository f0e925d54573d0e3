"""Linear layers (`y = x W^T + b`) with the fastest weight layout this CPU has, checked
against `F.linear` at start-up.

On a CPU, a bfloat16 matrix multiply is only fast where the CPU converts bfloat16 in
hardware (AVX-512 or AVX-NE-CONVERT). There oneDNN takes the weights prepacked
(`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`). Elsewhere (AVX2,
as on the 2-core benchmark machine) torch's bfloat16 GEMM goes a row at a time: at 32
rows it measured ~4x slower than a float32 GEMM, while for 1 to 4 rows (a decode step of
a few sequences, memory-bound) the bfloat16 weights, half the bytes, are faster. So
there a float32 copy of each weight serves inputs of `WIDE_ROWS` rows or more (the
activations are widened, multiplied, and rounded back to bfloat16, as bfloat16 GEMMs
accumulate in float32 anyway), as long as the copies fit in `WIDE_COPY_BUDGET`.

Every fast layout is checked once, at `plan` time, against `F.linear` on random rows
within `TOLERANCE`; one that does not hold is dropped with a log line, and `F.linear`
serves. Other dtypes and devices always use `F.linear`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: From this many rows a float32 copy beats torch's bfloat16 GEMM on an AVX2 CPU
#: (measured at 4 and 8 rows: 2.7 vs 3.4 ms and 6.6 vs 4.0 ms for one layer's linears).
WIDE_ROWS = 6
#: The most memory the float32 copies may take, in bytes.
WIDE_COPY_BUDGET = 4 << 30
#: Largest difference allowed, relative to the largest output, against `F.linear`.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Linear:
    """One weight (and bias) with the layouts `plan` chose for it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None  # oneDNN prepacked
        self.wide: torch.Tensor | None = None  # float32 copy
        self.wide_bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.wide is not None and x.shape[0] >= WIDE_ROWS:
            return F.linear(x.float(), self.wide, self.wide_bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def layout(self) -> str:
        return (
            "prepacked" if self.packed is not None else "wide" if self.wide is not None else "plain"
        )


def plan(linears: Sequence[Linear]) -> str:
    """Choose each linear's layout for its dtype and device; returns what was chosen."""
    if not linears:
        return "none"
    first = linears[0].weight
    if first.device.type != "cpu" or first.dtype != torch.bfloat16:
        return "F.linear"
    if _bf16_prepack_supported():
        for linear in linears:
            linear.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight)
            _verify(linear)
    elif sum(lin.weight.numel() for lin in linears) * 4 <= WIDE_COPY_BUDGET:
        for linear in linears:
            linear.wide = linear.weight.float()
            linear.wide_bias = None if linear.bias is None else linear.bias.float()
            _verify(linear)
    chosen = sorted({linear.layout() for linear in linears})
    return "+".join(chosen)


def _bf16_prepack_supported() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError):
        return False
    return True


def _verify(linear: Linear) -> None:
    """Drop the fast layouts of `linear` unless they agree with `F.linear`."""
    generator = torch.Generator().manual_seed(0)
    in_features = linear.weight.shape[1]
    for rows in (1, WIDE_ROWS + 3):
        x = torch.randn(rows, in_features, generator=generator).to(linear.weight.dtype)
        ref = F.linear(x, linear.weight, linear.bias).float()
        error = ((linear(x).float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        if not error <= TOLERANCE[linear.weight.dtype]:
            log.warning(
                "a %s linear layer differs from F.linear by %.1e; it uses F.linear",
                linear.layout(),
                error,
            )
            linear.packed = linear.wide = linear.wide_bias = None
            return
