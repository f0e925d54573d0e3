"""Linear layers (`y = x W^T + b`) with the fastest weight layout this CPU has, checked
against `F.linear` at start-up.

On a CPU, a bfloat16 matrix multiply is only fast where the CPU converts bfloat16 in
hardware (AVX-512 or AVX-NE-CONVERT). There oneDNN takes the weights prepacked
(`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`). Elsewhere (AVX2,
as on the 2-core benchmark machine) torch's bfloat16 GEMM goes a row at a time: at 32
rows it measured ~4x slower than a float32 GEMM, while for 1 to 3 rows (a decode step of
a few sequences, memory-bound) the bfloat16 weights, half the bytes, are faster. So
there each weight gets a float32 copy (`wide`), and, where oneDNN can prepack float32
weights, a prepacked form of that copy (`wide_packed`): inputs of `PACKED_WIDE_ROWS`
rows or more go through the prepacked copy, and only if it is missing through the plain
copy from `WIDE_ROWS` rows. The activations are widened, multiplied, and rounded back
to bfloat16, as bfloat16 GEMMs accumulate in float32 anyway. The plain copy stays for
`kernels/slicing.py`, which multiplies column slices of it. Prepacking matters because
MKL's float32 GEMM repacks the weights on every call, which at 32 rows costs more than
the multiply (one reference-model layer's linears at 32 rows: 2.6 ms prepacked against
3.6 ms). The copies are made while they fit in `WIDE_COPY_BUDGET` (the prepacked one
first to go).

A linear of one or two bfloat16 rows (a decode step of one or two sequences) goes
through the compiled library's `small_linear` where the CPU has AVX-512 BF16 (checked
against `F.linear` when the library loads): oneDNN takes ~18 µs a call before it
multiplies, and reads the weights slower than one pass dotting their rows. One decode
step's linears of the reference model at one row, 2 threads: 2.2 against 3.0 ms
(docs/benchmarks/README.md, "Measured settings": one- and two-row linears
through `small_linear`).

A prepacked multiply's rows are rounded up to a bucket (`bucket_rows`) and only the real
rows' outputs kept: oneDNN builds (JIT-compiles) its kernels for each row count the
first time it meets it, and the second call is as slow again, so a step with a new
count (a new mix of decode rows and prompts) paid ~15 ms a layer twice over (the four
linear shapes of the reference model at ~1,540 rows: 17-23 ms the first two calls,
4.1-4.8 after). Buckets bound the row counts to a few dozen, which are built before
the steps need them (`execution/warm_up.py`). A row's output does not depend on the
rows beside it, so the added rows are read from the input's storage where it goes on
that far (the forward's activations are allocated so, `empty_with_bucket_room`), else
from a zeroed copy. An in-process step of 1,507 rows, two alternating runs: median
78.0-79.6 ms in place, 78.6-82.9 with a copy a multiply, 77.3-77.9 unpadded.

Every fast layout is checked once, at `plan` time, against `F.linear` on random rows
within `TOLERANCE`; one that does not hold is dropped with a log line, and the next
layout down (or `F.linear`) serves. Other dtypes and devices always use `F.linear`.

A weight may also stay quantized as its GGUF file holds it (`kernels/quantized.py`):
such a `Linear` multiplies through `quantized_linear` (the compiled kernel, checked
when the library loads, or its torch twin) and `plan` leaves it as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .cpu_decode import cpu_kernel
from .quantized import QuantizedWeight, quantized_linear

log = logging.getLogger(__name__)

#: From this many rows a float32 copy beats torch's bfloat16 GEMM on an AVX2 CPU
#: (measured at 4 and 8 rows: 2.7 vs 3.4 ms and 6.6 vs 4.0 ms for one layer's linears).
WIDE_ROWS = 6
#: From this many rows the prepacked float32 copy beats the bfloat16 GEMM (one layer's
#: linears, AVX2, 2 threads: 1.4 / 1.3 ms at 3 rows, 1.5 / 1.8 at 4, 1.2 / 3.2 at 8).
PACKED_WIDE_ROWS = 4
#: The most memory the float32 copies may take, in bytes.
WIDE_COPY_BUDGET = 4 << 30
#: Most rows a bfloat16 linear sends to the compiled `small_linear` (one row: 34 against
#: 70 µs for a 1,024 x 512 weight; two: 51 against 75; four rows were slower for the
#: wide weights).
SMALL_ROWS = 2
#: Row buckets of a prepacked multiply: up to `BUCKET_SMALL_UNTIL` rows, a multiple of
#: `BUCKET_SMALL` (a few rows more cost next to nothing where the weights' reading is the
#: cost); past it, a multiple of `BUCKET_LARGE` (at most 4 % more rows at 1,536).
BUCKET_SMALL, BUCKET_SMALL_UNTIL, BUCKET_LARGE = 16, 256, 64
#: Largest difference allowed, relative to the largest output, against `F.linear`.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Linear:
    """One weight (and bias) with the layouts `plan` chose for it; a quantized weight's
    inputs are of `activation_dtype`."""

    def __init__(
        self,
        weight: torch.Tensor | QuantizedWeight,
        bias: torch.Tensor | None = None,
        activation_dtype: torch.dtype | None = None,
    ) -> None:
        self.weight = weight
        self.bias = bias
        if activation_dtype is None:
            assert isinstance(weight, torch.Tensor), "a quantized weight names its inputs' dtype"
            activation_dtype = weight.dtype
        self.activation_dtype = activation_dtype
        self.packed: torch.Tensor | None = None  # oneDNN prepacked
        self.wide: torch.Tensor | None = None  # float32 copy
        self.wide_packed: torch.Tensor | None = None  # oneDNN prepacked float32 copy
        self.wide_bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def quantized(self) -> QuantizedWeight | None:
        return self.weight if isinstance(self.weight, QuantizedWeight) else None

    @property
    def device(self) -> torch.device:
        return self.tensors()[0].device

    def tensors(self) -> list[torch.Tensor]:
        """The weight's (a quantized one's blocks) and the bias's tensors."""
        weight = self.weight.data if isinstance(self.weight, QuantizedWeight) else self.weight
        return [weight] if self.bias is None else [weight, self.bias]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return quantized_linear(x, self.weight, self.bias)
        if self.packed is not None:
            small = small_linear(x, self.weight, self.bias)
            return small if small is not None else prepacked(x, self.packed, self.bias)
        rows = x.shape[0]
        if self.wide_packed is not None and rows >= PACKED_WIDE_ROWS:
            return prepacked(x.float(), self.wide_packed, self.wide_bias).to(x.dtype)
        if self.wide is not None and rows >= WIDE_ROWS:
            return F.linear(x.float(), self.wide, self.wide_bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    @property
    def in_buckets(self) -> bool:
        """Whether some of its multiplies run at a row bucket (`prepacked`)."""
        return self.packed is not None or self.wide_packed is not None

    def layout(self) -> str:
        if isinstance(self.weight, QuantizedWeight):
            return f"quantized-{self.weight.qtype}"
        if self.packed is not None:
            return "prepacked"
        if self.wide is not None:
            return "wide-prepacked" if self.wide_packed is not None else "wide"
        return "plain"


def bucket_rows(rows: int) -> int:
    """The row count a prepacked multiply of `rows` rows runs at."""
    step = BUCKET_SMALL if rows <= BUCKET_SMALL_UNTIL else BUCKET_LARGE
    return -(-rows // step) * step


def row_buckets(up_to: int) -> list[int]:
    """Every bucket a multiply of 1 to `up_to` rows may run at, smallest first."""
    buckets = list(range(BUCKET_SMALL, min(up_to, BUCKET_SMALL_UNTIL) + BUCKET_SMALL, BUCKET_SMALL))
    if up_to > BUCKET_SMALL_UNTIL:
        buckets += range(BUCKET_SMALL_UNTIL + BUCKET_LARGE, bucket_rows(up_to) + 1, BUCKET_LARGE)
    return buckets


def empty_with_bucket_room(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.empty(shape)` whose storage goes on to `bucket_rows(shape[0])` rows (zeros),
    so that `prepacked` multiplies it, or a contiguous view of its rows, without a copy.
    Only on a CPU, where `prepacked` runs."""
    rows = shape[0]
    padded = bucket_rows(rows) if device.type == "cpu" else rows
    if padded == rows:
        return torch.empty(shape, dtype=dtype, device=device)
    storage = torch.empty((padded, *shape[1:]), dtype=dtype, device=device)
    storage[rows:] = 0
    return storage[:rows]


def prepacked(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, at: int | None = None
) -> torch.Tensor:
    """`x W^T + b` with W as `reorder` prepacked it, at `bucket_rows` rows (or `at`, a
    bucket at least as large): the rows past `x`'s are read from its storage where it
    goes on that far (`empty_with_bucket_room`; whatever they hold, their outputs are
    dropped), else from a zeroed copy."""
    rows, columns = x.shape
    padded = bucket_rows(rows) if at is None else at
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    needed = (x.storage_offset() + padded * columns) * x.element_size()
    if x.is_contiguous() and x.untyped_storage().nbytes() >= needed:
        buffer = x.as_strided((padded, columns), (columns, 1))
    else:
        buffer = x.new_empty(padded, columns)
        buffer[:rows] = x
        buffer[rows:] = 0
    return torch.ops.mkldnn._linear_pointwise(buffer, packed, bias, "none", [], "")[:rows]


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """`x W^T + b` by the compiled library for up to `SMALL_ROWS` bfloat16 rows; None,
    having done nothing, where it does not apply."""
    op = cpu_kernel().small_linear_op
    if (
        op is None
        or x.dim() != 2
        or x.shape[0] > SMALL_ROWS
        or x.dtype != torch.bfloat16
        or x.stride(-1) != 1
        or not weight.is_contiguous()
    ):
        return None
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    op(out, x, weight, bias)
    return out


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """`weight` prepacked for oneDNN's linear (`prepacked`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def plan(linears: Sequence[Linear]) -> str:
    """Choose each linear's layout for its dtype and device (a quantized one keeps its
    own); returns what was chosen."""
    if not linears:
        return "none"
    plain = [linear for linear in linears if linear.quantized is None]
    first = plain[0].weight if plain else None
    if not isinstance(first, torch.Tensor):
        return _layouts(linears)
    if first.device.type != "cpu" or first.dtype != torch.bfloat16:
        return "F.linear" if len(plain) == len(linears) else _layouts(linears)
    if _bf16_prepack_supported():
        for linear in plain:
            assert isinstance(linear.weight, torch.Tensor)
            linear.packed = reorder(linear.weight)
            if not _verify(linear):
                linear.packed = None
        return _layouts(linears)
    float32_bytes = sum(lin.in_features * lin.out_features for lin in plain) * 4
    if float32_bytes > WIDE_COPY_BUDGET:
        return _layouts(linears)
    prepack = 2 * float32_bytes <= WIDE_COPY_BUDGET and _float32_prepack_supported()
    for linear in plain:
        assert isinstance(linear.weight, torch.Tensor)
        linear.wide = linear.weight.float()
        linear.wide_bias = None if linear.bias is None else linear.bias.float()
        if prepack:
            linear.wide_packed = reorder(linear.wide)
            if _verify(linear):
                continue
            linear.wide_packed = None
        if not _verify(linear):
            linear.wide = linear.wide_bias = None
    return _layouts(linears)


def _layouts(linears: Sequence[Linear]) -> str:
    return "+".join(sorted({linear.layout() for linear in linears}))


def _prepack_supported(dtype: torch.dtype) -> bool:
    try:
        reorder(torch.zeros(8, 8, dtype=dtype))
    except (RuntimeError, AttributeError):
        return False
    return True


def _bf16_prepack_supported() -> bool:
    return _prepack_supported(torch.bfloat16)


def _float32_prepack_supported() -> bool:
    return _prepack_supported(torch.float32)


def _verify(linear: Linear) -> bool:
    """Whether `linear`, as it is laid out now, agrees with `F.linear` (on rows that take
    each of its layouts); logs the layout that does not."""
    generator = torch.Generator().manual_seed(0)
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    for rows in (1, PACKED_WIDE_ROWS, WIDE_ROWS + 3):
        x = torch.randn(rows, linear.in_features, generator=generator).to(weight.dtype)
        ref = F.linear(x, weight, linear.bias).float()
        error = ((linear(x).float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        if not error <= TOLERANCE[weight.dtype]:
            log.warning(
                "a %s linear layer differs from F.linear by %.1e at %d rows; it does not "
                "use that layout",
                linear.layout(),
                error,
                rows,
            )
            return False
    return True
