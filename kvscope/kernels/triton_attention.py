"""Paged-attention decode in Triton (the CUDA path).

`paged_decode(query, key_cache, value_cache, block_tables, context_lens, scale)` takes
the same inputs as the decode half of the torch reference (`attention.py`) and returns
the same output:

* `query` [batch, heads, dim], one token per sequence;
* `key_cache` / `value_cache` [num_blocks, block_size, kv_heads, dim];
* `block_tables` [batch, max_blocks] block ids, `context_lens` [batch] tokens to attend;
* returns [batch, heads, dim] in the query's dtype.

One program handles one (sequence, kv head) pair and all the query heads that share it
(grouped-query attention), walking the sequence's blocks with an online softmax in
float32, so each K/V block is read once per kv head. Sizes that are not powers of two
(head dim, block size, group size) are padded and masked.

This module imports `triton` at import time; `attention.py` imports it lazily, only
for CUDA tensors. Under `TRITON_INTERPRET=1` the kernel also runs on CPU tensors,
which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# One kernel, longer than the ~60 lines a function gets elsewhere: a Triton kernel
# cannot call out to Python helpers, and splitting it into @triton.jit pieces would
# hide the one loop (over the KV blocks, with the online softmax) that it is.
@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_P: tl.constexpr,
    DIM_P: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, GROUP_P)
    dims = tl.arange(0, DIM_P)
    slots = tl.arange(0, BLOCK_P)
    head_ok = tl.arange(0, GROUP_P) < GROUP
    dim_ok = dims < HEAD_DIM

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    context = tl.load(lens_ptr + seq)
    num_blocks = (context + BLOCK_SIZE - 1) // BLOCK_SIZE

    m = tl.full([GROUP_P], -1.0e30, tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, DIM_P], tl.float32)
    for i in range(0, num_blocks):
        block = tl.load(tables_ptr + seq * stride_tb + i).to(tl.int64)
        token_ok = (slots < BLOCK_SIZE) & (i * BLOCK_SIZE + slots < context)
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_ptr
            + block * stride_kb
            + slots[:, None] * stride_ks
            + kv_head * stride_kh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr
            + block * stride_vb
            + slots[:, None] * stride_vs
            + kv_head * stride_vh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_P, BLOCK_P]
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    out = acc / total[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dim_ok[None, :],
    )


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V (see module doc)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} kv heads of dim {cache_dim}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the K/V caches must be contiguous in their last dimension")
    query = query.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(batch, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP_P=triton.next_power_of_2(group),
        DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_P=triton.next_power_of_2(block_size),
    )
    return out
