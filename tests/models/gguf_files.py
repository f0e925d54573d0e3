"""Small GGUF files for the tests, written as llama.cpp's converter writes them.

`write_gguf` turns a Hugging Face state dict (and a tokenizer described by its tokens,
types and merges) into a GGUF file with `gguf.GGUFWriter`: tensors renamed the
converter's way, q and k rows permuted within each head for the `llama` architecture
(`LlamaModel.permute` in convert_hf_to_gguf.py), each matrix quantized to the type
`qtype_of(name)` chooses. `convert_checkpoint` does it for a tiny HF checkpoint
directory of tests/models/conftest.py. The name table and the permutation here are
written from llama.cpp's converter, not taken from kvscope, so the tests hold the
loader against them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

Q = GGMLQuantizationType

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

#: The types the tiny files mix, one matrix after another.
MIXED_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.F32)


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (`LlamaModel.permute`)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def mixed_types(names: list[str]) -> Callable[[str], Any]:
    """Each matrix of `names` the next of `MIXED_TYPES`; vectors stay F32."""
    matrices = [n for n in names if not n.endswith(("norm.weight", "bias"))]
    chosen = {name: MIXED_TYPES[i % len(MIXED_TYPES)] for i, name in enumerate(matrices)}
    return lambda name: chosen.get(name, Q.F32)


def roundtrip(weight: np.ndarray, qtype: Any) -> np.ndarray:
    """`weight` as the file's type holds it: quantized, then dequantized."""
    return np.asarray(dequantize(quantize(weight, qtype), qtype), dtype=np.float32).reshape(
        weight.shape
    )


def write_gguf(
    path: Path,
    *,
    arch: str,
    hf_config: dict[str, Any],
    weights: dict[str, np.ndarray],
    tokenizer: dict[str, Any],
    qtype_of: Callable[[str], Any],
    metadata: dict[str, Any] | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
) -> Path:
    """A GGUF file of `weights` (HF names, float32) for architecture `arch`."""
    c = hf_config
    writer = GGUFWriter(str(path), arch)
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    for key, value in {
        "block_count": c["num_hidden_layers"],
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "attention.key_length": c["head_dim"],
        "rope.dimension_count": c["head_dim"],
        "vocab_size": weights["model.embed_tokens.weight"].shape[0],
    }.items():
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10_000.0)
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    _write_tokenizer(writer, tokenizer)
    for key, value in (metadata or {}).items():
        _add_value(writer, key, value)
    for name, weight in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = permute(weight, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = permute(weight, kv_heads)
        qtype = qtype_of(name)
        writer.add_tensor(gguf_name(name), quantize(weight, qtype), raw_dtype=qtype)
    for name, (data, qtype) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def _write_tokenizer(writer: GGUFWriter, tokenizer: dict[str, Any]) -> None:
    for key, value in tokenizer.items():
        _add_value(writer, f"tokenizer.{key}", value)


def byte_level_tokenizer(directory: Path) -> dict[str, Any]:
    """The GGUF tokenizer metadata of a HF byte-level BPE `tokenizer.json` (as the
    converter writes it: every token in id order, special ones as control tokens)."""
    document = json.loads((directory / "tokenizer.json").read_text())
    vocab = document["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in document["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in document["model"]["merges"]]
    return {
        "ggml.model": "gpt2",
        "ggml.pre": "gpt-2",
        "ggml.tokens": tokens,
        "ggml.token_type": [3 if t in special else 1 for t in tokens],
        "ggml.merges": merges,
        "ggml.bos_token_id": vocab["<s>"],
        "ggml.eos_token_id": vocab["</s>"],
        "ggml.padding_token_id": vocab["<pad>"],
        "ggml.add_bos_token": True,
    }


def convert_checkpoint(
    directory: Path, path: Path, *, arch: str, qtype_of: Callable[[str], Any] | None = None
) -> tuple[Path, dict[str, np.ndarray]]:
    """The tiny HF checkpoint in `directory` as the GGUF file `path`, and its weights
    as the file holds them (each quantized and dequantized), in HF's layout."""
    from safetensors.numpy import load_file

    config = json.loads((directory / "config.json").read_text())
    weights = {
        k: v.astype(np.float32) for k, v in load_file(directory / "model.safetensors").items()
    }
    qtype_of = qtype_of or mixed_types(list(weights))
    write_gguf(
        path,
        arch=arch,
        hf_config=config,
        weights=weights,
        tokenizer=byte_level_tokenizer(directory),
        qtype_of=qtype_of,
    )
    return path, {name: roundtrip(w, qtype_of(name)) for name, w in weights.items()}
