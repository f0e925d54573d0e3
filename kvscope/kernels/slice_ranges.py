"""Where a sliced linear layer is cut (`kernels/slicing.py`): its output columns into
nearly equal pieces on aligned cuts (`column_ranges`), its input rows into ranges that
follow the rows' bucket (`row_ranges`), and a piece of a weight's rows as a view
(`row_range`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvscope.kernels.linear import BUCKET_LARGE, BUCKET_SMALL, BUCKET_SMALL_UNTIL, bucket_rows
from kvscope.kernels.quantized import QuantizedWeight

#: Pieces are cut on multiples of this many columns (of each half, for gate_up's paired
#: pieces): oneDNN multiplies other widths slower. The reference model at 2,048 rows on
#: the 2-core AMX machine, gate_up in 3 paired pieces: its MLP took 7.1 ms with halves
#: of 469-470 columns against 5.4 with 448-512 (4.9 whole), and an in-process step of 8
#: prompts of 256 tokens 109-111 ms against 92 (89-92 whole), medians of two runs each.
ALIGN = 64


class RowRange(NamedTuple):
    """Rows of a layer's input, and the row count their multiply runs at."""

    rows: slice
    at: int


def row_ranges(rows: int, parts: int) -> list[RowRange]:
    """`parts` nearly equal ranges of `rows` rows, cut as those of its bucket
    (`bucket_rows`) are, on multiples of the bucket's step, each multiplied at the row
    count of that bucket's range: a step multiplies at the row counts of the warm-up
    step of its bucket, whose kernels are built. Only the last range is short of it."""
    padded = bucket_rows(rows)
    unit = BUCKET_LARGE if padded > BUCKET_SMALL_UNTIL else BUCKET_SMALL
    parts = max(1, min(parts, padded // unit))
    cuts = [round(i * (padded // unit) / parts) * unit for i in range(parts)] + [padded]
    return [
        RowRange(slice(lo, min(hi, rows)), hi - lo)
        for lo, hi in zip(cuts, cuts[1:], strict=False)
        if lo < rows
    ]


def column_ranges(size: int, pieces: int) -> list[tuple[int, int]]:
    """The (start, end) columns of `pieces` nearly equal pieces of `size` columns, cut
    on multiples of `ALIGN` where every piece can have one."""
    unit = ALIGN if size >= ALIGN * pieces else 1
    cuts = [round(i * (size // unit) / pieces) * unit for i in range(pieces)] + [size]
    return list(zip(cuts, cuts[1:], strict=False))


def row_range(
    weight: torch.Tensor | QuantizedWeight, lo: int, hi: int
) -> torch.Tensor | QuantizedWeight:
    """Rows `lo:hi` of a weight (its output columns), a view whatever its type."""
    return weight.rows(lo, hi) if isinstance(weight, QuantizedWeight) else weight[lo:hi]
