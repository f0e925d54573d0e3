"""Slicing a long linear layer so that the forward's next checkpoint is never far away.

A cancel waits for the forward's next checkpoint. Between two of them lies at least one
matrix multiply, and in a step that carries a long prefill chunk one multiply takes
tens of milliseconds on a CPU. `LinearSlicer` splits a linear layer's output columns
into pieces, with a checkpoint after each, so that no piece takes longer than
`target` seconds. Columns rather than rows: on a CPU a linear layer costs about
`a + b * rows` (a: reading the weights, b: multiplying one row), and a column slice
reads only its own weights, so `s` pieces cost a `1/s` share of both; row slices would
each read all the weights again, which is most of a decode step's cost.

`a` and `b` are measured once for each distinct weight shape, the first time one is
met (the quickest of a few calls at 1 and `PROBE_ROWS` rows), so the number of pieces
follows this machine and this thread count. Only CPU tensors are sliced: elsewhere the
forward does not wait for its kernels, so timing a call says nothing. A piece has at
least `MIN_COLUMNS` columns, and the pieces are views of the weights (no copy) for the
plain and float32-copy layouts; a prepacked weight is sliced in its plain form, and a
prepacked float32 copy as the plain float32 copy beside it (the probe times the
prepacked one, ~10 % quicker at the hundreds of rows that get sliced).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvscope.kernels.linear import WIDE_ROWS, Linear

#: Rows of the second probe call (the first has one).
PROBE_ROWS = 64
#: Fewest output columns in one piece: narrower multiplies lose their efficiency (on
#: the 2-core AVX2 machine a 511-row step took 15-35 % more CPU time in pieces of at
#: least 64 columns than whole, 12-14 % with 256; from 159 rows down, no measurable
#: cost; docs/cancellation.md).
MIN_COLUMNS = 256


class LinearSlicer:
    """How many pieces each linear layer is cut into, for a given number of rows."""

    def __init__(self, target: float, *, min_columns: int = MIN_COLUMNS) -> None:
        self.target = target
        self.min_columns = min_columns
        self._costs: dict[tuple[int, ...], tuple[float, float]] = {}  # shape -> (a, b)
        self._pieces: dict[
            tuple[int, int, bool], list[tuple[torch.Tensor, torch.Tensor | None]]
        ] = {}
        self._keep: dict[int, Linear] = {}  # keeps the ids above meaningful

    def pieces(self, linear: Linear, rows: int) -> int:
        if linear.weight.device.type != "cpu":
            return 1
        a, b = self.cost(linear)
        most = max(1, linear.out_features // self.min_columns)
        return min(most, max(1, math.ceil((a + b * rows) / self.target)))

    def cost(self, linear: Linear) -> tuple[float, float]:
        """(a, b) of `linear`'s shape, measured on first use."""
        shape = (*linear.weight.shape, linear.weight.dtype.itemsize, linear.bias is not None)
        if shape not in self._costs:
            self._costs[shape] = _probe(linear)
        return self._costs[shape]

    def __call__(
        self, linear: Linear, x: torch.Tensor, checkpoint: Callable[[], None] | None
    ) -> torch.Tensor:
        """`linear(x)`, in column pieces with `checkpoint()` between two of them."""
        pieces = 1 if checkpoint is None else self.pieces(linear, x.shape[0])
        if pieces == 1:
            return linear(x)
        wide = linear.wide is not None and x.shape[0] >= WIDE_ROWS
        x_in = x.float() if wide else x  # widened once, not once a piece
        outputs = []
        for index, (weight, bias) in enumerate(self._split(linear, pieces, wide)):
            if index:
                checkpoint()  # type: ignore[misc]
            outputs.append(F.linear(x_in, weight, bias))
        out = torch.cat(outputs, dim=-1)
        return out.to(x.dtype) if wide else out

    def _split(
        self, linear: Linear, pieces: int, wide: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) views of each piece, in the float32 copy's layout if `wide`."""
        key = (id(linear), pieces, wide)
        if key not in self._pieces:
            self._keep[id(linear)] = linear
            weight, bias = (linear.wide, linear.wide_bias) if wide else (linear.weight, linear.bias)
            assert weight is not None
            bounds = [round(i * linear.out_features / pieces) for i in range(pieces + 1)]
            self._pieces[key] = [
                (weight[lo:hi], None if bias is None else bias[lo:hi])
                for lo, hi in zip(bounds, bounds[1:], strict=False)
            ]
        return self._pieces[key]


def _probe(linear: Linear) -> tuple[float, float]:
    def quickest(rows: int) -> float:
        x = torch.randn(rows, linear.weight.shape[1]).to(linear.weight.dtype)
        linear(x)  # warm-up: first-call allocations and kernel selection
        best = math.inf
        for _ in range(5):
            started = time.perf_counter()
            linear(x)
            best = min(best, time.perf_counter() - started)
        return best

    with torch.inference_mode():
        one, many = quickest(1), quickest(PROBE_ROWS)
    b = max(0.0, (many - one) / (PROBE_ROWS - 1))
    return max(0.0, one - b), b
