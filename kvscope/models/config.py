"""`ModelConfig`: the architecture facts the decoder needs, read from a HF config."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ModelConfig:
    architecture: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head's q and k before rotary (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
