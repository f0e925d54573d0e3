"""The decoder's elementwise steps: `rms_norm`, `silu_and_mul` (the MLP's
`silu(gate) * up`) and `rope_and_cache` (the rotary embedding of q and k, and the
write of k and v into the paged cache), each one pass over its rows through the
compiled CPU library (`csrc/elementwise.cpp`) once it is loaded, torch's unfused ops
otherwise (other devices, other dtypes, before the library is ready, and where no
compiler exists).

The fused ops round where torch's do, so bfloat16 results match torch's bit for bit but
where a float32 intermediate lands on the other side of a rounding boundary (measured on
512 rows of the reference model's widths: none of 720,896 `silu_and_mul` outputs, 2 of
262,144 `rms_norm` outputs, by one bfloat16 step). On the 2-core AMX machine, 512 rows:
`rms_norm` 0.05 against 0.12 ms, `silu_and_mul` 0.40 against 0.49 ms (2,048 rows: 0.41
against 1.59, 1.6 against 2.4). `rope_and_cache` replaces five passes over q and k
and two `index_copy_` calls (its cache writes cost what theirs did: they wait for the
cache's misses, which the block-major layout makes fewer, `attention_backend.block_major_cache`).
They never start the library's build: the decode backend does
(`attention_backend.decode_backend`).
"""

from __future__ import annotations

import torch

from .cpu_decode import DTYPES, cpu_kernel
from .linear import empty_with_bucket_room
from .reference import torch_rms_norm, torch_silu_and_mul


def _compiled(x: torch.Tensor) -> bool:
    """Whether the compiled ops take `x`: a CPU matrix of their dtypes whose rows are
    contiguous."""
    return x.device.type == "cpu" and x.dtype in DTYPES and x.dim() == 2 and x.stride(-1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    op = cpu_kernel().rms_norm_op
    if op is None or not _compiled(x) or weight.dtype != x.dtype:
        return torch_rms_norm(x, weight, eps)
    out = empty_with_bucket_room(*x.shape, dtype=x.dtype, device=x.device)
    op(out, x, weight, eps)
    return out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for x [rows, 2n], into `out` ([rows, n], its rows
    contiguous: a column range of a wider matrix will do) where given."""
    op = cpu_kernel().silu_and_mul_op
    if op is None or not _compiled(x) or (out is not None and not _compiled(out)):
        result = torch_silu_and_mul(x)
        return result if out is None else out.copy_(result)
    if out is None:
        out = empty_with_bucket_room(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    op(out, x)
    return out


def rope_and_cache(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> bool:
    """Rotate `qk` ([tokens, q heads + kv heads, dim]) in place as
    `rope.apply_rotary` would, and write its kv heads and `v` into the caches
    at `slots` as `reference.write_slots` would; False, having done nothing, where the
    compiled op does not apply (the caller then does both with torch)."""
    op = cpu_kernel().rope_and_cache_op
    if op is None or qk.device.type != "cpu" or qk.dtype not in DTYPES:
        return False
    dim = qk.shape[-1]
    heads_contiguous = all(t.stride(-1) == 1 and t.stride(-2) == dim for t in (qk, v))
    if not (
        heads_contiguous
        and slots.dtype == torch.int64
        and all(t.dtype == qk.dtype for t in (v, cos, sin, key_cache, value_cache))
        and cos.stride(-1) == 1
        and sin.stride() == cos.stride()
        and key_cache.stride(-1) == 1
        and value_cache.stride(-1) == 1
    ):
        return False
    op(qk, v, cos, sin, slots.contiguous(), key_cache, value_cache)
    return True
