"""A checkpoint's tensors against its config: the name and shape of each tensor the
Llama-family decoder (`models/llama.py`) takes, checked before any is copied. A
tensor may be a plain tensor or a `QuantizedWeight` (its logical shape counts).
`WeightReader` hands them to the decoder in its dtype and on its device: a matrix kept
quantized where its partners in a fused linear share its block type, dequantized where
they do not."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from kvscope.kernels.linear import Linear
from kvscope.kernels.quantized import QuantizedWeight, concat_rows, dequantize

from .config import ModelConfig
from .errors import ModelLoadError

__all__ = ["Weight", "WeightReader", "check_weights", "expected_shapes"]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, under Hugging Face's names, with its shape."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[attn + f"{name}_proj.weight"] = (rows, c.hidden_size)
            if c.attention_bias:
                shapes[attn + f"{name}_proj.bias"] = (rows,)
        shapes[attn + "o_proj.weight"] = (c.hidden_size, q)
        if c.qk_norm:
            shapes[attn + "q_norm.weight"] = (c.head_dim,)
            shapes[attn + "k_norm.weight"] = (c.head_dim,)
        shapes[mlp + "gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[mlp + "up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[mlp + "down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


Weight = torch.Tensor | QuantizedWeight


def check_weights(config: ModelConfig, weights: Mapping[str, Weight]) -> list[str]:
    """Raise `ModelLoadError` naming missing or misshapen tensors; return the names of
    tensors the decoder does not use."""
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    for name, shape in expected.items():
        actual = tuple(weights[name].shape)
        if actual != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {actual}, but config.json implies {shape}"
            )
    return [name for name in weights if name not in expected and name != "lm_head.weight"]


class WeightReader:
    """A checkpoint's tensors as the decoder holds them (`dtype`, `device`)."""

    def __init__(
        self, weights: Mapping[str, Weight], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.weights, self.dtype, self.device = weights, dtype, device

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`, dequantized if it is quantized."""
        weight = self.weights[name]
        if isinstance(weight, QuantizedWeight):
            return dequantize(weight, torch.float32).to(device=self.device, dtype=self.dtype)
        return weight.to(device=self.device, dtype=self.dtype)

    def linear(self, *names: str, bias: torch.Tensor | None = None) -> Linear:
        """The matrices `names` fused into one linear layer (their rows in turn): kept
        quantized where all are quantized in one block type."""
        parts = [self.weights[name] for name in names]
        quantized = [part for part in parts if isinstance(part, QuantizedWeight)]
        if len(quantized) == len(parts) and len({part.qtype for part in quantized}) == 1:
            fused = concat_rows(quantized)
            on_device = attrs.evolve(fused, data=fused.data.to(self.device))
            return Linear(on_device, bias, activation_dtype=self.dtype)
        return Linear(torch.cat([self.tensor(name) for name in names]), bias)
