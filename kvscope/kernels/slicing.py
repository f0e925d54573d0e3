"""Slicing a long linear layer, so that the forward's next checkpoint is never far
away (a prefill's attention is cut too: `kernels/attention_slicing.py`, its pieces
learned by the slicer's `attention`).

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
least `MIN_COLUMNS` columns, its cuts fall on multiples of `ALIGN` columns
(`column_ranges`, `kernels/slice_ranges.py`), and the pieces are views of the weights
(no copy) for the plain and float32-copy layouts.

Where the columns run out (a step of 1,536 rows: the reference model's four 256-column
pieces of qkv took ~5 ms each at one thread on the 2-core AVX2 machine), the rows are
cut too (`cut`, `row_ranges`): ranges of at least `MIN_ROWS` rows, each of which
multiplies every column piece in turn, reading the pieces' weights once a range. The
ranges are cut as those of the rows' bucket are, and each multiplies at its range's
row count there, so a step runs at the row counts of its bucket's warm-up step, whose
oneDNN kernels are built. A float32 copy's input is widened a range at a time.

Measured in-process, 32 prompts of 512 tokens at a 2 ms target, reference model, AVX2
machine: the checkpoint gap's p99 went from 22 to 4.6 ms at one thread (4.3 at two),
where rope and the attention of 1,536 rows took up to 26 ms in one gap and gate_up's
last piece with the whole activation's `silu_and_mul` 12; 32 streams of 256-token
prompts decoded 536 tok/s against 548 (six alternating runs each, within their spread).

A prepacked weight, bfloat16 or a float32 copy, is sliced into prepacked pieces (oneDNN's
reorder of each piece, made the first time that cut is met), while they fit in
`PACKED_PIECES_BUDGET`: a plain bfloat16 weight multiplies at a third of the speed, so two plain
pieces cost more than the whole (a 2,048-row step of the reference model: 258 ms with the MLP in
plain pieces against 170 whole), and plain float32 pieces are repacked by MKL at every call (on
the 2-core AVX2 machine, where bfloat16 does not prepack, 32 streams in-process: 594-662 tok/s
with the lm_head's two plain pieces against 725-800 prepacked, 219-249 against 267-271 with
256-token prompts; docs/benchmarks/README.md, "Measured settings": linear pieces prepacked
within a budget). Past the budget, pieces are plain views as above.

The gated MLP (`gated_mlp`: `residual + down(silu(gate) * up)`) is cut so that no piece
output is concatenated: gate_up's pieces (of the bfloat16 weight or of its float32
copy) pair each gate column range with the same up range, so each piece's
`silu_and_mul` writes its own columns of the activation (these pieces are copies, so
only prepacked ones are made; past the budget gate_up is cut as any layer is), and
down's pieces add the residual into their own columns of the output. (Cutting down by
its input columns instead, adding partial products, would round each partial to
bfloat16: not the layer's result.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvscope.kernels.attention_slicing import AttentionSlicer
from kvscope.kernels.fused import silu_and_mul
from kvscope.kernels.linear import (
    WIDE_ROWS,
    Linear,
    bucket_rows,
    empty_with_bucket_room,
    prepacked,
    reorder,
)
from kvscope.kernels.quantized import QuantizedWeight, quantized_linear
from kvscope.kernels.slice_ranges import RowRange, column_ranges, row_range, row_ranges

#: Rows of the second probe call (the first has one).
PROBE_ROWS = 64
#: Fewest output columns in one piece: narrower multiplies lose their efficiency (on
#: the 2-core AVX2 machine a 511-row step took 15-35 % more CPU time in pieces of at
#: least 64 columns than whole, 12-14 % with 256; from 159 rows down, no measurable
#: cost; docs/cancellation.md).
MIN_COLUMNS = 256
#: Fewest rows in one row range of a layer cut by rows too (`row_ranges`): a multiply
#: of fewer rows reads the whole piece of weights for too little work.
MIN_ROWS = 64
#: The most memory the prepacked pieces of all linear layers may take, in bytes.
PACKED_PIECES_BUDGET = 1 << 30


class Piece(NamedTuple):
    """One piece of a linear layer: its output columns, and its weight as it multiplies
    (a view of the plain weight, or a prepacked copy)."""

    columns: int
    weight: torch.Tensor | QuantizedWeight  # a quantized layer's pieces are row views
    bias: torch.Tensor | None
    packed: bool


class LinearSlicer:
    """How many pieces each linear layer is cut into, for a given number of rows."""

    def __init__(self, target: float, *, min_columns: int = MIN_COLUMNS) -> None:
        self.target = target
        self.min_columns = min_columns
        #: (shape, layout, input dtype's size, bias) -> (a, b)
        self._costs: dict[tuple[object, ...], tuple[float, float]] = {}
        #: (id of the layer, pieces, which cut: "plain", "wide" or "paired") -> pieces
        self._pieces: dict[tuple[int, int, str], list[Piece]] = {}
        self._keep: dict[int, Linear] = {}  # keeps the ids above meaningful
        self._packed_bytes = 0
        #: How many pieces a prefill's attention is cut into (`kernels.attention`).
        self.attention = AttentionSlicer(target)

    def pieces(self, linear: Linear, rows: int) -> int:
        """How many column pieces `linear` is cut into at `rows` rows."""
        return self.cut(linear, rows)[0]

    def cut(self, linear: Linear, rows: int) -> tuple[int, list[RowRange]]:
        """(column pieces, row ranges) of `linear` at `rows` rows: columns first, and
        rows too once the columns alone cannot bring a piece within `target`. Both
        follow the rows' bucket (`bucket_rows`), so a step cuts its layers as the
        warm-up step of its bucket did, whose multiplies built the same kernels."""
        whole = [RowRange(slice(0, rows), bucket_rows(rows))]
        if linear.device.type != "cpu":
            return 1, whole
        a, b = self.cost(linear)
        padded = bucket_rows(rows)
        wanted = max(1, math.ceil((a + b * padded) / self.target))
        most = max(1, linear.out_features // self.min_columns)
        if wanted <= most:
            return wanted, whole
        return most, row_ranges(rows, min(math.ceil(wanted / most), padded // MIN_ROWS))

    def within_target(self, linears: list[Linear], rows: int) -> bool:
        """Whether `linears` run back to back at `rows` rows, with no checkpoint
        between them, are expected to take at most `target` (a fused layer).

        At the rows themselves, not their bucket: the fused layer's compiled call
        multiplies only the rows it has (at one row the bucket's 16 would count a
        quantized layer 6-8x over, and a probe slowed by a busy machine then kept the
        layers unfused for good)."""
        if any(linear.device.type != "cpu" for linear in linears):
            return False
        costs = (self.cost(linear) for linear in linears)
        return sum(a + b * rows for a, b in costs) <= self.target

    def cost(self, linear: Linear) -> tuple[float, float]:
        """(a, b) of `linear`'s shape and layout, measured on first use."""
        shape = (
            linear.out_features,
            linear.in_features,
            linear.layout(),
            linear.activation_dtype.itemsize,
            linear.bias is not None,
        )
        if shape not in self._costs:
            self._costs[shape] = _probe(linear)
        return self._costs[shape]

    def __call__(
        self, linear: Linear, x: torch.Tensor, checkpoint: Callable[[], None] | None
    ) -> torch.Tensor:
        """`linear(x)`, in pieces with `checkpoint()` between two of them."""
        if checkpoint is None:
            return linear(x)
        columns, ranges = self.cut(linear, x.shape[0])
        if columns == 1 and len(ranges) == 1:
            return linear(x)
        wide = _takes_wide(linear, x)
        pieces = self._split(linear, columns, wide)
        out = torch.empty(x.shape[0], linear.out_features, dtype=x.dtype, device=x.device)
        for rows, start, piece, product in _products(x, wide, pieces, ranges, checkpoint):
            out[rows, start : start + piece.columns] = product
        return out

    def gated_mlp(
        self,
        gate_up: Linear,
        down: Linear,
        x: torch.Tensor,
        residual: torch.Tensor,
        checkpoint: Callable[[], None] | None,
    ) -> torch.Tensor:
        """`residual + down(silu_and_mul(gate_up(x)))` in pieces, with `checkpoint()`
        between two pieces and between the two layers."""
        if checkpoint is None:
            return residual + down(silu_and_mul(gate_up(x)))
        rows = x.shape[0]
        columns, ranges = self.cut(gate_up, rows)
        wide = _takes_wide(gate_up, x)
        paired = self._paired(gate_up, columns, wide) if columns > 1 else None
        if paired is not None:
            activation = empty_with_bucket_room(
                rows, gate_up.out_features // 2, dtype=x.dtype, device=x.device
            )
            products = _products(x, wide, paired, ranges, checkpoint, halves=True)
            for part, start, piece, product in products:
                width = piece.columns // 2
                silu_and_mul(product.to(x.dtype), activation[part, start : start + width])
        else:
            activation = silu_and_mul(self(gate_up, x, checkpoint))
        checkpoint()
        columns, ranges = self.cut(down, rows)
        if columns == 1 and len(ranges) == 1:
            return residual + down(activation)
        wide = _takes_wide(down, activation)
        out = torch.empty_like(residual)
        pieces = self._split(down, columns, wide)
        for part, start, piece, product in _products(activation, wide, pieces, ranges, checkpoint):
            cut = (part, slice(start, start + piece.columns))
            torch.add(residual[cut], product.to(x.dtype), out=out[cut])
        return out

    def forget(self) -> None:
        """Drop every piece and the layers they came from (their model released its
        weights: the pieces would keep them, and their prepacked copies, alive)."""
        self._pieces.clear()
        self._keep.clear()
        self._packed_bytes = 0

    def _split(self, linear: Linear, pieces: int, wide: bool) -> list[Piece]:
        """The pieces of `linear` (of its float32 copy if `wide`): prepacked where the
        layer is and the budget allows, views of the plain weight otherwise."""
        key = (id(linear), pieces, "wide" if wide else "plain")
        if key not in self._pieces:
            self._keep[id(linear)] = linear
            weight, bias = (linear.wide, linear.wide_bias) if wide else (linear.weight, linear.bias)
            assert weight is not None
            packed = linear.wide_packed if wide else linear.packed
            pack = packed is not None and isinstance(weight, torch.Tensor) and self._reserve(weight)
            self._pieces[key] = [
                _piece(row_range(weight, lo, hi), None if bias is None else bias[lo:hi], pack)
                for lo, hi in column_ranges(weight.shape[0], pieces)
            ]
        return self._pieces[key]

    def _paired(self, gate_up: Linear, pieces: int, wide: bool) -> list[Piece] | None:
        """`gate_up`'s pieces (of its float32 copy if `wide`), each a column range of the
        gate and the same range of up, prepacked; None where that layout is not
        prepacked or the budget is spent (the ranges are copies, which only pay as
        prepacked ones)."""
        key = (id(gate_up), pieces, "paired-wide" if wide else "paired")
        if key not in self._pieces:
            weight, bias = (
                (gate_up.wide, gate_up.wide_bias) if wide else (gate_up.weight, gate_up.bias)
            )
            packed = gate_up.wide_packed if wide else gate_up.packed
            if not isinstance(weight, torch.Tensor) or packed is None or not self._reserve(weight):
                return None
            self._keep[id(gate_up)] = gate_up
            half = weight.shape[0] // 2
            pairs = []
            for lo, hi in column_ranges(half, pieces):
                rows = torch.cat([torch.arange(lo, hi), torch.arange(half + lo, half + hi)])
                pairs.append(_piece(weight[rows], None if bias is None else bias[rows], True))
            self._pieces[key] = pairs
        return self._pieces[key]

    def _reserve(self, weight: torch.Tensor) -> bool:
        """Whether a prepacked copy of `weight` fits in the budget (and, if so, count it)."""
        size = weight.numel() * weight.element_size()
        if self._packed_bytes + size > PACKED_PIECES_BUDGET:
            return False
        self._packed_bytes += size
        return True


def _takes_wide(linear: Linear, x: torch.Tensor) -> bool:
    """Whether `linear`'s pieces for `x` are of its float32 copy (as `Linear` chooses)."""
    return linear.wide is not None and x.shape[0] >= WIDE_ROWS


def _products(
    x: torch.Tensor,
    wide: bool,
    pieces: list[Piece],
    ranges: list[RowRange],
    checkpoint: Callable[[], None],
    *,
    halves: bool = False,
) -> Iterator[tuple[slice, int, Piece, torch.Tensor]]:
    """(rows, first output column, piece, its product over those rows) for each piece of
    each row range in turn, with `checkpoint()` between two (with `halves`, the columns
    count in each half of a paired piece). For float32 pieces `x` is widened a row
    range at a time into rows with bucket room, which prepacked pieces read in place
    (`prepacked` would copy a plain `x.float()` again for each piece)."""
    x_in = empty_with_bucket_room(*x.shape, dtype=torch.float32, device=x.device) if wide else x
    first = True
    for rows, at in ranges:
        if wide:
            x_in[rows] = x[rows]
        start = 0
        for piece in pieces:
            if not first:
                checkpoint()
            first = False
            yield rows, start, piece, _multiply(piece, x_in[rows], at)
            start += piece.columns // 2 if halves else piece.columns


def _piece(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, pack: bool) -> Piece:
    if pack:
        assert isinstance(weight, torch.Tensor)
        return Piece(weight.shape[0], reorder(weight.contiguous()), bias, True)
    return Piece(weight.shape[0], weight, bias, False)


def _multiply(piece: Piece, x: torch.Tensor, at: int | None = None) -> torch.Tensor:
    if isinstance(piece.weight, QuantizedWeight):
        return quantized_linear(x, piece.weight, piece.bias)
    if piece.packed:
        return prepacked(x, piece.weight, piece.bias, at)
    return F.linear(x, piece.weight, piece.bias)


def _probe(linear: Linear) -> tuple[float, float]:
    def quickest(rows: int) -> float:
        x = torch.randn(rows, linear.in_features).to(linear.activation_dtype)
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
