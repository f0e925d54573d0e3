"""The compiled library's self-checks: before first use, each op of the library
(`cpu_decode.py`) is run on small random inputs and held against its torch reference
(`reference.py`, `rope.py`); one that is off by more than `CHECK_RTOL` raises, and the
library is not used.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from .reference import reference_decode, torch_rms_norm, torch_silu_and_mul, write_slots
from .rope import apply_rotary

DTYPES = (torch.float32, torch.bfloat16)
#: The relative error the start-up check allows against the torch reference.
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def check_decode(op: Callable[..., None]) -> None:
    """Raise unless `op` agrees with the torch reference on a small ragged GQA batch
    and on one sequence long enough to be cut into spans. The head size, 32, takes
    every vector path there is (AVX-512 BF16's dot products need a multiple of 32)."""
    generator = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, dim = 4, 2, 4, 32
    ragged = torch.tensor([1, 7, 12], dtype=torch.int32), 3
    long = torch.tensor([300], dtype=torch.int32), 75
    for dtype in DTYPES:
        for lens, width in (ragged, long):
            batch = len(lens)
            blocks = batch * width + 1

            def rand(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.randn(*shape, generator=generator).to(dtype)

            keys = rand(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
            values = rand(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
            order = torch.randperm(blocks, generator=generator)
            tables = order[: batch * width].view(batch, width).contiguous()
            query = rand(batch, heads, dim)
            out = torch.empty_like(query)
            op(out, query, keys, values, tables, lens, dim**-0.5)
            ref = reference_decode(query, keys, values, tables, lens, dim**-0.5)
            require_close(out, ref, f"{dtype} result")


def check_prefill(op: Callable[..., None]) -> None:
    """Raise unless the prefill `op` agrees with the decode reference taking each row on
    its own (the chunk's blocks, its causal length): a first chunk, a later one that
    starts inside a block, and a one-row chunk, with GQA and a block size of 4."""
    generator = torch.Generator().manual_seed(1)
    block_size, kv_heads, heads, dim = 4, 2, 4, 32
    starts, lengths = [0, 6, 13], [9, 7, 1]
    width = max(-(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True))
    for dtype in DTYPES:

        def rand(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(dtype)

        blocks = len(starts) * width + 1
        keys = rand(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
        values = rand(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
        tables = torch.randperm(blocks, generator=generator)[: len(starts) * width]
        tables = tables.view(len(starts), width).contiguous()
        query = rand(sum(lengths), heads, dim)
        out = torch.empty_like(query)
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        op(out, query, keys, values, tables, torch.tensor(starts, dtype=torch.int32), offsets, 0.2)
        row_tables = tables.repeat_interleave(torch.tensor(lengths), dim=0)
        row_lens = torch.cat(
            [torch.arange(s + 1, s + n + 1) for s, n in zip(starts, lengths, strict=True)]
        ).to(torch.int32)
        ref = reference_decode(query, keys, values, row_tables, row_lens, 0.2)
        require_close(out, ref, f"{dtype} prefill result")


def check_elementwise(silu_and_mul: Callable[..., None], rms_norm: Callable[..., None]) -> None:
    """Raise unless the fused ops agree with torch's unfused ones (rows of a width the
    vector path does not divide, so its tail loop runs too)."""
    generator = torch.Generator().manual_seed(2)
    for dtype in DTYPES:
        x = (3 * torch.randn(5, 74, generator=generator)).to(dtype)
        weight = (torch.rand(74, generator=generator) + 0.5).to(dtype)
        activated, normed = x.new_empty(5, 37), torch.empty_like(x)
        silu_and_mul(activated, x)
        rms_norm(normed, x, weight, 1e-6)
        require_close(activated, torch_silu_and_mul(x), f"{dtype} silu_and_mul")
        require_close(normed, torch_rms_norm(x, weight, 1e-6), f"{dtype} rms_norm")


def check_small_linear(small_linear: Callable[..., None]) -> None:
    """Raise unless `small_linear` agrees with `F.linear` in bfloat16 (one and two rows,
    a width the vector path takes and one it does not, with and without a bias)."""
    generator = torch.Generator().manual_seed(4)
    for rows, k, biased in ((1, 64, False), (2, 64, True), (2, 40, True)):
        x = torch.randn(rows, k, generator=generator).bfloat16()
        weight = torch.randn(70, k, generator=generator).bfloat16()
        bias = torch.randn(70, generator=generator).bfloat16() if biased else None
        out = x.new_empty(rows, 70)
        small_linear(out, x, weight, bias)
        require_close(out, torch.nn.functional.linear(x, weight, bias), "small_linear")


def check_rope_and_cache(rope_and_cache: Callable[..., None]) -> None:
    """Raise unless the fused rotary embedding and cache write agree with
    `apply_rotary` and `write_slots` (a head dim the vector path does not divide)."""
    generator = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        tokens, heads, kv_heads, dim = 5, 3, 1, 20
        qk = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
        v = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
        angles = torch.rand(tokens, dim // 2, generator=generator) * 6
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
        slots = torch.tensor([9, 0, 17, 4, 30])
        caches = [torch.zeros(kv_heads, 4, 8, dim, dtype=dtype).permute(1, 2, 0, 3) for _ in "kvKV"]
        rotated = qk.clone()
        rope_and_cache(rotated, v, cos, sin, slots, caches[0], caches[1])
        expected = apply_rotary(qk, cos, sin)
        write_slots(caches[2], slots, expected[:, heads - kv_heads :])
        write_slots(caches[3], slots, v)
        require_close(rotated, expected, f"{dtype} rope_and_cache")
        require_close(caches[0], caches[2], f"{dtype} rope_and_cache keys")
        require_close(caches[1], caches[3], f"{dtype} rope_and_cache values")


def require_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Raise unless `out` is within `CHECK_RTOL` of `ref`, relative to its largest value."""
    error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if not error <= CHECK_RTOL[out.dtype]:
        raise RuntimeError(f"{what} off by {error:.1e} relative")
