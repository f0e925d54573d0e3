"""`apply_rotary` against Hugging Face's own `apply_rotary_pos_emb`: bit for bit, in
every dtype the engine serves, with plain and llama3-scaled tables."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels.rope import apply_rotary, rotary_tables

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rotation_is_transformers_bit_for_bit(dtype, scaling) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(0)
    cos, sin = rotary_tables(64, 500_000.0, scaling, 4096, torch.device("cpu"))
    positions = torch.randint(0, 4096, (300,), generator=generator)
    cos, sin = cos[positions].to(dtype), sin[positions].to(dtype)
    q = (3 * torch.randn(300, 8, 64, generator=generator)).to(dtype)
    k = (3 * torch.randn(300, 4, 64, generator=generator)).to(dtype)
    # transformers: [batch, heads, tokens, dim], cos/sin [batch, tokens, dim].
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    assert torch.equal(apply_rotary(q, cos, sin), expected_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), expected_k[0].transpose(0, 1))
