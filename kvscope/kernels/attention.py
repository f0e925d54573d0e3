"""Reference paged attention in torch: writes new K/V into the paged cache through a
slot mapping, then attends each query over its sequence's blocks.

A step's tokens are laid out flat: first one token for each decoding sequence, then the
prefill chunks one after another. `AttentionMetadata` is built once per step (not once
per layer) and says where each goes:

* decode rows `[0, num_decode)` attend, as one batched `scaled_dot_product_attention`
  call, over their gathered blocks with a padding mask;
* each prefill chunk attends over its blocks with a causal mask shifted by the tokens
  already in the cache (plain `is_causal` when there are none).

There are no per-token Python loops; grouped-query attention uses SDPA's `enable_gqa`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F


@attrs.frozen
class PrefillSpan:
    start: int  # first row of the chunk in the flat token layout
    end: int
    blocks: torch.Tensor  # [num_blocks] block ids covering the context
    context_len: int  # tokens in the cache once this chunk is written
    mask: torch.Tensor | None  # [chunk, context] bool, None when causal from position 0


@attrs.frozen
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each token
    num_decode: int
    decode_tables: torch.Tensor | None  # [num_decode, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool
    prefills: tuple[PrefillSpan, ...]


def build_metadata(
    *,
    starts: Sequence[int],
    lengths: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences laid out in order, those with `length == 1` first.

    `starts[i]` is how many tokens of sequence i are already in the cache, `lengths[i]`
    how many this step adds, `block_tables[i]` its blocks.
    """
    slots: list[int] = []
    for start, length, table in zip(starts, lengths, block_tables, strict=True):
        for pos in range(start, start + length):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)

    num_decode = 0
    while num_decode < len(lengths) and lengths[num_decode] == 1:
        num_decode += 1
    decode_tables = decode_mask = None
    if num_decode:
        context = [starts[i] + 1 for i in range(num_decode)]
        width = max(len(block_tables[i]) for i in range(num_decode))
        padded = [list(block_tables[i]) + [0] * (width - len(block_tables[i])) for i in range(num_decode)]
        decode_tables = torch.tensor(padded, dtype=torch.long, device=device)
        positions = torch.arange(width * block_size, device=device)
        lens = torch.tensor(context, device=device)
        decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]

    prefills = []
    row = num_decode
    for i in range(num_decode, len(lengths)):
        start, length = starts[i], lengths[i]
        context_len = start + length
        num_blocks = -(-context_len // block_size)
        blocks = torch.tensor(block_tables[i][:num_blocks], dtype=torch.long, device=device)
        mask = None
        if start:
            q_pos = torch.arange(start, context_len, device=device)
            k_pos = torch.arange(context_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
        prefills.append(PrefillSpan(row, row + length, blocks, context_len, mask))
        row += length
    return AttentionMetadata(slot_mapping, num_decode, decode_tables, decode_mask, tuple(prefills))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write `key`/`value` ([tokens, kv_heads, dim]) into the cache, then attend.

    `query` is [tokens, heads, dim]; returns [tokens, heads * dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    flat_keys = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_values = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_keys.index_copy_(0, meta.slot_mapping, key)
    flat_values.index_copy_(0, meta.slot_mapping, value)

    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if meta.num_decode:
        n = meta.num_decode
        keys = _gather(key_cache, meta.decode_tables)
        values = _gather(value_cache, meta.decode_tables)
        q = query[:n].unsqueeze(2)  # [n, heads, 1, dim]
        out[:n] = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        ).squeeze(2)
    for span in meta.prefills:
        keys = _gather(key_cache, span.blocks[None])[..., : span.context_len, :]
        values = _gather(value_cache, span.blocks[None])[..., : span.context_len, :]
        q = query[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        attended = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[span.start : span.end] = attended[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[batch, max_blocks] block ids -> [batch, kv_heads, max_blocks * block_size, dim]."""
    batch, width = tables.shape
    _, block_size, heads, dim = cache.shape
    return cache[tables].view(batch, width * block_size, heads, dim).transpose(1, 2)
