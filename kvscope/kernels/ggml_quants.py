"""GGML's quantized block layouts and their reference dequantization in torch.

A row of a quantized weight is a run of blocks; each block holds `elems` values in
`nbytes` bytes: float16 scales (and mins) and packed integer codes (llama.cpp's
`ggml-common.h`). `dequantize_rows` turns rows of blocks into floats with the same
float32 operations, in the same order, as the `gguf` package's numpy code
(`gguf/quants.py`, llama.cpp's own), so the two agree exactly; it is vectorised over
all blocks at once (no loop per block). It is the torch fallback's weight and the
reference the compiled kernels (`csrc/quant_matmul.cpp`) are held against.
`random_blocks` makes rows of valid random blocks of any type, for those checks, and
`check_quant_ops` is the check the compiled ops pass when the library loads
(`cpu_decode`): the multiply through 8-bit activations against `quantized_reference`,
which quantizes them exactly as the kernels do, within float32 summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

__all__ = [
    "BLOCKS",
    "COMPILED_TYPES",
    "EXACT_RTOL",
    "LINEAR_RTOL",
    "SUPPORTED_TYPES",
    "Block",
    "check_quant_ops",
    "dequantize_rows",
    "quantized_reference",
    "random_blocks",
]


@attrs.frozen
class Block:
    """One GGML block type: `elems` values in `nbytes` bytes."""

    elems: int
    nbytes: int


#: Every type `dequantize_rows` reads; the float types are blocks of one value.
BLOCKS: dict[str, Block] = {
    "F32": Block(1, 4),
    "F16": Block(1, 2),
    "BF16": Block(1, 2),
    "Q8_0": Block(32, 34),
    "Q4_0": Block(32, 18),
    "Q4_1": Block(32, 20),
    "Q5_0": Block(32, 22),
    "Q5_1": Block(32, 24),
    "Q4_K": Block(256, 144),
    "Q5_K": Block(256, 176),
    "Q6_K": Block(256, 210),
}
SUPPORTED_TYPES = frozenset(BLOCKS)
#: Where each type keeps its float16 scales, as byte offsets in the block (for
#: `random_blocks`, which must write finite ones).
_HALF_OFFSETS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32, shape (..., 1)."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n): the low nibbles, then the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 8n) bits, least significant first (a little-endian word)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[..., 2:].contiguous().view(torch.int8).float() * _half(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * _nibbles(b[..., 4:]).float() + _half(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    codes = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4)
    return _half(b, 0) * (codes.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    codes = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << 4)
    return _half(b, 0) * codes.float() + _half(b, 2)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's eight 6-bit scales and mins from their 12 bytes."""
    d, m, low = packed.unflatten(-1, (3, 4)).unbind(-2)
    scales = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _k_quant(b: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Q4_K and Q5_K: eight groups of 32 codes, each `d * scale * q - dmin * min`."""
    scales, mins = _k_scales_mins(b[..., 4:16])
    d = (_half(b, 0) * scales).unsqueeze(-1)
    dm = (_half(b, 2) * mins).unsqueeze(-1)
    return (d * codes.float() - dm).flatten(-2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # 4 runs of 32 bytes, each the low nibbles of one group, then the high of the next
    return _k_quant(
        b, _nibbles(b[..., 16:].unflatten(-1, (4, 32))).unflatten(-1, (2, 32)).flatten(-3, -2)
    )


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[..., 48:].unflatten(-1, (4, 32))).unflatten(-1, (2, 32)).flatten(-3, -2)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).unsqueeze(-1)
    high = (b[..., 16:48].unsqueeze(-2) >> shifts) & 1  # group g: bit g of each byte
    return _k_quant(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 values: low nibbles of 64 bytes, then their high nibbles; the
    # top two bits from 32 bytes, two bits a group of 32.
    low = _nibbles(b[..., :128].unflatten(-1, (2, 64))).unflatten(-1, (4, 32))
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).unsqueeze(-1)
    high = (b[..., 128:192].unflatten(-1, (2, 1, 32)) >> shifts) & 3
    codes = ((low | (high << 4)).to(torch.int8) - 32).flatten(-3).unflatten(-1, (16, 16))
    d = (_half(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return (d * codes.float()).flatten(-2)


_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize_rows(
    qtype: str, data: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`data` (rows, row bytes) uint8 of `qtype` blocks -> (rows, in_features) of `dtype`,
    through float32 exactly as `gguf.quants.dequantize` computes it."""
    if qtype in _FLOATS:
        return data.view(_FLOATS[qtype]).to(dtype)
    block = BLOCKS[qtype]
    blocks = data.view(data.shape[0], in_features // block.elems, block.nbytes)
    return _DECODERS[qtype](blocks).reshape(data.shape[0], in_features).to(dtype)


def random_blocks(
    qtype: str, rows: int, in_features: int, generator: torch.Generator, scale: float = 0.02
) -> torch.Tensor:
    """(rows, row bytes) of random valid `qtype` blocks: random codes, and float16 scales
    drawn around `scale` (mins around -8 * scale, so values centre near 0)."""
    block = BLOCKS[qtype]
    count = in_features // block.elems
    if qtype in _FLOATS:
        values = torch.randn(rows, in_features, generator=generator).to(_FLOATS[qtype])
        return values.view(torch.uint8)
    raw = torch.randint(0, 256, (rows, count, block.nbytes), generator=generator, dtype=torch.uint8)
    for i, at in enumerate(_HALF_OFFSETS[qtype]):
        halves = scale * (0.5 + torch.rand(rows, count, 1, generator=generator))
        if i == 1 and qtype in ("Q4_1", "Q5_1"):
            halves = -8 * halves  # a min; K-quants' dmin is subtracted, so stays positive
        raw[..., at : at + 2] = halves.half().view(torch.uint8)
    return raw.view(rows, count * block.nbytes)


#: The relative error (of the largest output) allowed a multiply through 8-bit
#: quantized activations against `F.linear` on the dequantized weight; measured
#: ~0.5e-2 on random blocks and rows, with bfloat16 or float32 inputs.
LINEAR_RTOL = 2e-2
#: What the compiled multiply may differ by from `quantized_reference`, relative to the
#: largest output, by its output dtype: float32 sums in another order (measured ~3e-7),
#: one bfloat16 rounding (at most 2^-9).
EXACT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
#: The block types the compiled library (`csrc/quant_matmul.cpp`) multiplies.
COMPILED_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})
#: What the compiled dequantization may differ by, relative to the largest value: float32
#: where a compiler fuses the scale and the min, one bfloat16 rounding.
DEQUANTIZE_RTOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def quantized_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x W^T + b` as the compiled multiply computes it, in float64: each row of `x`
    (float32 values) quantized a group of 32 to codes round(v * 127 / amax) (to nearest
    even, in float32) with scale amax / 127, times the dequantized `weight` (float32)."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse).double()
    y = (codes * (amax / 127.0).double()).reshape(x.shape) @ weight.double().T
    return y if bias is None else y + bias.double()


def check_quant_ops(linear_op: Callable[..., None], dequantize_op: Callable[..., None]) -> None:
    """Raise unless the compiled `quant_linear` and `quant_dequantize` agree with
    `quantized_reference` and `dequantize_rows` on random blocks of every type: one row
    and five (a tile of four and one), float32 and bfloat16, with a bias; rows of two
    K-quant blocks, and for the types of 32 values, rows of 5 blocks too (a kernel that
    takes 4 blocks at a time has one left over)."""
    generator = torch.Generator().manual_seed(5)
    n = 37
    for qtype in sorted(COMPILED_TYPES):
        for k in (512,) if BLOCKS[qtype].elems > 32 else (512, 160):
            data = random_blocks(qtype, n, k, generator)
            reference = dequantize_rows(qtype, data, k)
            for dtype in (torch.float32, torch.bfloat16):
                values = torch.empty(n, k, dtype=dtype)
                dequantize_op(values, data, qtype)
                expected_values = reference.to(dtype)
                rtol = DEQUANTIZE_RTOL[dtype]
                _require_close(values, expected_values, rtol, f"{qtype} {dtype} dequantize")
                for rows in (1, 5):
                    x = torch.randn(rows, k, generator=generator).to(dtype)
                    bias = torch.randn(n, generator=generator).to(dtype)
                    out = x.new_empty(rows, n)
                    linear_op(out, x, data, qtype, k, bias)
                    expected = quantized_reference(x, reference, bias)
                    _require_close(out, expected, EXACT_RTOL[dtype], f"{qtype} {dtype} linear")


def _require_close(out: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if not error <= rtol:
        raise RuntimeError(f"{what} off by {error:.1e} relative")
