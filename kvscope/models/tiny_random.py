"""The `tiny-random` model: a two-layer Llama with seeded random weights under Hugging
Face's tensor names and the byte tokenizer, for tests and quick runs.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import LlamaModel
from .loaded import LoadedModel
from .tokenizer import ByteTokenizer

TINY_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    bos_token_id=ByteTokenizer.bos_token_id,
    eos_token_ids=ByteTokenizer.eos_token_ids,
)


def random_weights(config: ModelConfig, seed: int, std: float = 0.5) -> dict[str, torch.Tensor]:
    """Seeded random weights under Hugging Face's tensor names."""
    gen = torch.Generator().manual_seed(seed)
    c = config

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std / shape[-1] ** 0.5 * 4

    weights = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size)}
    weights["model.norm.weight"] = torch.ones(c.hidden_size)
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(c.hidden_size)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(c.hidden_size)
        weights[p + "self_attn.q_proj.weight"] = rand(q, c.hidden_size)
        weights[p + "self_attn.k_proj.weight"] = rand(kv, c.hidden_size)
        weights[p + "self_attn.v_proj.weight"] = rand(kv, c.hidden_size)
        weights[p + "self_attn.o_proj.weight"] = rand(c.hidden_size, q)
        weights[p + "mlp.gate_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        weights[p + "mlp.up_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        weights[p + "mlp.down_proj.weight"] = rand(c.hidden_size, c.intermediate_size)
    return weights


def tiny_random(*, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    model = LlamaModel(TINY_CONFIG, random_weights(TINY_CONFIG, seed), dtype=dtype, device=device)
    return LoadedModel(
        name="tiny-random", model=model, tokenizer=ByteTokenizer(), config=TINY_CONFIG
    )
