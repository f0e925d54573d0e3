"""A GGUF file's tensors under Hugging Face's names: dequantized, or kept in their blocks.

llama.cpp's converter renames every tensor (`blk.N.attn_q.weight` for
`model.layers.N.self_attn.q_proj.weight`, ...), writes each shape innermost dimension
first (a `(out, in)` weight has `ne = [in, out]`), and, for the `llama` architecture
only, permutes the rows of q and k within each head (`LlamaModel.permute` in
convert_hf_to_gguf.py) to pair neighbouring values in its rotary embedding. `hf_name`
maps the names back; `unpermute_rows` is the row order that undoes the permutation, a
row gather, so it applies to a quantized weight's blocks as to its values, since every
row is quantized on its own.

`read_weights` reads every tensor, each either dequantized to float32 or, where the
caller asks, kept as a `QuantizedWeight` (its raw blocks, one row per output feature);
`dequantized_weights` and `quantized_weights` (every matrix kept) are its two
plain uses. A tensor whose
name or GGML type kvscope does not serve is refused with `ModelLoadError` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from kvscope.kernels.quantized import QuantizedWeight

from .errors import ModelLoadError

__all__ = [
    "SERVED_TYPES",
    "check_tensors",
    "dequantized_weights",
    "hf_name",
    "quantized_weights",
    "served_type",
    "read_weights",
    "unpermute_rows",
]

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **{
        f"attn_{n}.{kind}": f"self_attn.{n}_proj.{kind}"
        for n in "qkv"
        for kind in ("weight", "bias")
    },
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")

#: The GGML types served (dequantized at load): plain floats, and the block types
#: llama.cpp's common files use.
SERVED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

#: The matrices a quantized kernel may multiply: the linear layers' weights, and the
#: embedding table (a tied model's output head).
MATRICES = re.compile(r".*_proj\.weight|lm_head\.weight|model\.embed_tokens\.weight")


def hf_name(name: str) -> str:
    """The Hugging Face name of GGUF tensor `name`."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}"
    if name == "rope_freqs.weight":
        raise ModelLoadError(
            "GGUF tensor 'rope_freqs.weight' (Llama 3.1-style rope scaling) is not supported"
        )
    raise ModelLoadError(f"GGUF tensor {name!r} is not one of a Llama-family decoder")


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order undoing llama.cpp's q/k permutation of a `rows`-row weight of
    `heads` heads: its row `(h, i, j)` (head, pair, half) is Hugging Face's row
    `(h, j, i)`, so row `(h, j, i)` of the result gathers row `(h, i, j)`."""
    if rows % (2 * heads):
        raise ModelLoadError(f"a q/k weight of {rows} rows does not split into {heads} heads")
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def row_orders(hf_config: Mapping[str, Any], permuted: bool) -> dict[str, int]:
    """The head count each permuted tensor's rows were permuted by (none unless
    `permuted`, as llama.cpp permutes only its `llama` architecture)."""
    if not permuted:
        return {}
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    orders = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for proj, count in (("q", heads), ("k", kv_heads)):
            for kind in ("weight", "bias"):
                orders[f"model.layers.{layer}.self_attn.{proj}_proj.{kind}"] = count
    return orders


def served_type(tensor: Any) -> str:
    """The GGML type name of a reader tensor, refused unless served."""
    name = tensor.tensor_type.name
    if name not in SERVED_TYPES:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} has type {name}, which kvscope does not serve; "
            f"served: {', '.join(SERVED_TYPES)}"
        )
    return str(name)


def check_tensors(tensors: list[Any]) -> None:
    """Refuse a file holding a tensor kvscope does not know or whose type it does not
    serve, naming it, before any is read."""
    for tensor in tensors:
        served_type(tensor)
        hf_name(tensor.name)


def _writable(array: np.ndarray) -> np.ndarray:
    """`array`, copied out of the file's read-only memory map where it is a view of it."""
    return array if array.flags.writeable else array.copy()


def _dequantized(tensor: Any, heads: int | None) -> torch.Tensor:
    from gguf.quants import dequantize

    shape = [int(n) for n in reversed(tensor.shape.tolist())]
    values = torch.from_numpy(_writable(dequantize(tensor.data, tensor.tensor_type)))
    values = values.reshape(shape)
    return values if heads is None else values[unpermute_rows(shape[0], heads)]


def _quantized(tensor: Any, heads: int | None) -> QuantizedWeight:
    qtype = served_type(tensor)
    if len(tensor.shape) != 2:
        raise ModelLoadError(f"GGUF tensor {tensor.name!r} is not a matrix")
    columns, rows = (int(n) for n in tensor.shape.tolist())
    data = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(rows, -1))
    if heads is not None:
        data = data[unpermute_rows(rows, heads)].contiguous()
    return QuantizedWeight(qtype, (rows, columns), data)


def read_weights(
    tensors: list[Any],
    orders: Mapping[str, int],
    *,
    keep_quantized: Callable[[str], bool] = lambda name: False,
    progress: bool = False,
    desc: str = "dequantizing",
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor of `tensors` (a checked `GGUFReader`'s, `check_tensors`) under its
    Hugging Face name, the rows of those in `orders` put back in Hugging Face's order:
    a `QuantizedWeight` where `keep_quantized(name)` holds for a matrix (`MATRICES`),
    else dequantized to float32; with a progress bar (tqdm, on stderr) if asked."""
    from tqdm import tqdm

    total = sum(int(t.n_bytes) for t in tensors)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress)
    with bar:
        for tensor in tensors:
            name = hf_name(tensor.name)
            heads = orders.get(name)
            if MATRICES.fullmatch(name) and keep_quantized(name):
                weights[name] = _quantized(tensor, heads)
            else:
                weights[name] = _dequantized(tensor, heads)
            bar.update(int(tensor.n_bytes))
    return weights


def dequantized_weights(
    tensors: list[Any], orders: Mapping[str, int], *, progress: bool = False, desc: str = ""
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, under its Hugging Face name."""
    weights = read_weights(tensors, orders, progress=progress, desc=desc or "dequantizing")
    return {name: w for name, w in weights.items() if isinstance(w, torch.Tensor)}


def quantized_weights(tensors: list[Any], orders: Mapping[str, int]) -> dict[str, QuantizedWeight]:
    """Each matrix (`MATRICES`) as a `QuantizedWeight`, in Hugging Face's row order."""
    named = {hf_name(t.name): t for t in tensors}
    return {
        name: _quantized(tensor, orders.get(name))
        for name, tensor in named.items()
        if MATRICES.fullmatch(name)
    }
