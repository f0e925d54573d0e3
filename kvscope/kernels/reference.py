"""The torch references: the plain twins of the compiled kernels, which the kernels are
checked against when they load (`cpu_checks.py`) and which serve wherever no kernel does.

Attention: `reference_decode` (a decode row over its gathered blocks), `sdpa_own_rows`
and `sdpa_prefill` (prefill chunks through torch's SDPA), `write_slots` (the K/V cache
write); the fused elementwise steps: `torch_rms_norm`, `torch_silu_and_mul`. The cache
they read is block-major or head-major (`attention_backend.block_major_cache`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

#: torch's flash attention on the CPU runs chunks whose length is not a multiple of 16
#: at up to half speed (8 chunks of 254 tokens: 5.4-7.1 ms against 2.9 padded to 256,
#: AMX machine, 2 threads), so `sdpa_own_rows` pads them to one.
CPU_SDPA_LENGTH_MULTIPLE = 16


DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def reference_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention in torch: query [batch, heads, dim] over each row's blocks
    ([batch, max_blocks] ids, `context_lens` tokens); returns [batch, heads, dim].

    Two batched matrix multiplies with the query heads grouped under their KV head:
    for one query row, this is several times faster on the CPU than
    `scaled_dot_product_attention`, whose CPU kernels are built for long queries.
    Scores and softmax are in float32."""
    batch, heads, dim = query.shape
    keys = _gather_head_major(key_cache, block_tables)  # [kv_heads, batch, width, dim]
    values = _gather_head_major(value_cache, block_tables)
    kv_heads, _, width, _ = keys.shape
    grouped = query.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # [kvh, b, g, w]
    if mask is None:
        mask = padding_mask(context_lens, width)
    scores.masked_fill_(~mask.view(1, batch, 1, width), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(batch, heads, dim)


def padding_mask(context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[batch, 1, 1, width] bool: True where a position is inside the context."""
    positions = torch.arange(width, device=context_lens.device)
    return (positions[None, :] < context_lens[:, None])[:, None, None, :]


def sdpa_own_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, count: int, scale: float
) -> torch.Tensor:
    """`count` chunks of one length laid out one after another (query [rows, heads,
    dim], key and value [rows, kv_heads, dim]), each attending causally over its own
    rows; returns [rows, heads, dim]. On the CPU a chunk is padded at its end to a
    multiple of `CPU_SDPA_LENGTH_MULTIPLE` tokens: under the causal mask only the
    padding rows see the padding keys, and they are dropped."""
    length = query.shape[0] // count
    padded = length
    if query.device.type == "cpu":
        padded = -(-length // CPU_SDPA_LENGTH_MULTIPLE) * CPU_SDPA_LENGTH_MULTIPLE

    def batched(x: torch.Tensor) -> torch.Tensor:  # [count, heads, padded, dim]
        rows = x.view(count, length, *x.shape[1:]).transpose(1, 2)
        if padded == length:
            return rows
        out = x.new_zeros(count, x.shape[1], padded, x.shape[2])
        out[:, :, :length] = rows
        return out

    attended = F.scaled_dot_product_attention(
        batched(query),
        batched(key),
        batched(value),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return attended[:, :, :length].transpose(1, 2).reshape(query.shape)


def sdpa_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    context_len: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One chunk's rows (query [n, heads, dim]) over its gathered `blocks`: causal from
    position 0 when `mask` is None, else as `mask` [n, context_len] says."""
    keys = _gather(key_cache, blocks[None])[..., :context_len, :]
    values = _gather(value_cache, blocks[None])[..., :context_len, :]
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, heads, n, dim]
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` ([tokens, kv_heads, dim]) into flat cache `slots` of `cache`
    ([blocks, block_size, kv_heads, dim], head-major or block-major storage)."""
    num_blocks, block_size, heads, dim = cache.shape
    head_major = cache.permute(2, 0, 1, 3)
    if head_major.is_contiguous():
        head_major.view(heads, num_blocks * block_size, dim).index_copy_(
            1, slots, values.transpose(0, 1)
        )
    else:
        cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slots, values)


def _gather_head_major(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [kv_heads, batch, max_blocks * block_size, dim].

    With the cache's head-major storage (see `KVCache`) this is one `index_select` into
    a contiguous result, laid out as the batched matrix multiplies want it."""
    batch, width = tables.shape
    num_blocks, block_size, heads, dim = cache.shape
    head_major = cache.permute(2, 0, 1, 3)
    if not head_major.is_contiguous():  # block-major storage: gather whole blocks, then
        # lay the heads out first (one copy; index_select from the permuted view is ~10x slower)
        blocks = cache.index_select(0, tables.reshape(-1))
        return blocks.permute(2, 0, 1, 3).reshape(heads, batch, width * block_size, dim)
    # index_select copies whole blocks ~3x faster from a 3-d view than a 4-d one.
    head_major = head_major.view(heads, num_blocks, block_size * dim)
    gathered = head_major.index_select(1, tables.reshape(-1))
    return gathered.view(heads, batch, width * block_size, dim)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [batch, kv_heads, max_blocks * block_size, dim]."""
    return _gather_head_major(cache, tables).transpose(0, 1)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (normalised in float32, scaled after the cast back), with
    torch's fused kernel for the float32 part."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
