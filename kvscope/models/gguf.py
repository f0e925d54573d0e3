"""GGUF files (llama.cpp's format): what `load_model` needs to serve one.

`gguf_path` says whether a model name is a GGUF file (a `.gguf` path, or a directory
holding exactly one `.gguf` and no `config.json`). `read_gguf` opens it with the `gguf`
package's reader (llama.cpp's own; the tensor data stays memory-mapped) and returns a
`GGUFCheckpoint`: the Hugging Face config the metadata describes (the dict
`hf_checkpoint.model_config_from_hf` reads, so one place turns a config into a `ModelConfig`),
the file's own dtype, its tokenizer (`models/gguf_tokenizer.py`) and chat template, and
its tensors, read under Hugging Face's names by `models/gguf_weights.py`: dequantized
(what the decoder serves today) or each linear weight kept in its GGML blocks as a
`QuantizedWeight`.

Served: the architectures `llama` (which is also how GGUF writes Mistral), `qwen2` and
`qwen3`; rope scaling none or linear. Anything else (another architecture, a split
file, partial rotary, an unknown tensor or tensor type) is refused with
`ModelLoadError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from kvscope.kernels.quantized import SUPPORTED_TYPES, QuantizedWeight

from .chat import compile_template
from .errors import ModelLoadError
from .gguf_tokenizer import gguf_tokenizer
from .gguf_weights import (
    check_tensors,
    dequantized_weights,
    hf_name,
    quantized_weights,
    read_weights,
    row_orders,
    served_type,
)
from .tokenizer import HFTokenizer

__all__ = ["ARCHITECTURES", "GGUFCheckpoint", "gguf_path", "read_gguf"]

#: GGUF `general.architecture` → the Hugging Face class it was converted from.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: Only llama.cpp's `llama` architecture has its q/k rows permuted by the converter.
PERMUTED_ARCHITECTURES = ("llama",)
#: The dtype each plain float GGML type serves as under `dtype="auto"`; a file with
#: block-quantized weights serves as bfloat16.
PLAIN_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
QUANTIZED_DTYPE = "bfloat16"
#: Show the progress bar while dequantizing a file of at least this many bytes.
PROGRESS_BYTES = 32 * 2**20


def gguf_path(path: Path) -> Path | None:
    """The GGUF file `path` names, or None if it names none."""
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise ModelLoadError(f"no GGUF file {path}")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise ModelLoadError(f"{path} holds {len(files)} GGUF files ({names}); name one")
        return files[0] if files else None
    return None


@attrs.frozen(kw_only=True)
class GGUFCheckpoint:
    path: Path
    #: The `config.json` the metadata describes.
    hf_config: dict[str, Any]
    #: The file's own dtype: its float type, or bfloat16 for a quantized file.
    dtype: str
    tokenizer: HFTokenizer
    chat_template: str | None
    #: The reader's tensors (their data memory-mapped from the file).
    tensors: list[Any]
    #: Hugging Face name → the head count its rows were permuted by.
    row_orders: dict[str, int]

    def weights(self, *, progress: bool | None = None) -> dict[str, torch.Tensor]:
        """Every tensor dequantized to float32, with a progress bar (tqdm, on stderr)
        for a file of `PROGRESS_BYTES` or more (`progress=None`) or when asked."""
        if progress is None:
            progress = self.path.stat().st_size >= PROGRESS_BYTES
        desc = f"dequantizing {self.path.name}"
        return dequantized_weights(self.tensors, self.row_orders, progress=progress, desc=desc)

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        """Each linear layer's weight (and the embedding table) in its GGML blocks,
        rows in Hugging Face's order."""
        return quantized_weights(self.tensors, self.row_orders)

    def mixed_weights(
        self, keep_quantized: Callable[[str], bool], *, progress: bool = False
    ) -> dict[str, torch.Tensor | QuantizedWeight]:
        """Every tensor: a matrix for which `keep_quantized(name)` holds as a
        `QuantizedWeight`, the rest dequantized to float32."""
        desc = f"reading {self.path.name}"
        return read_weights(
            self.tensors, self.row_orders, keep_quantized=keep_quantized, progress=progress,
            desc=desc,
        )  # fmt: skip

    def served_weights(self) -> dict[str, torch.Tensor | QuantizedWeight]:
        """The weights as the model serves the file as it is: each matrix in a GGML
        block type the quantized kernels multiply kept in its blocks, the rest (float
        types, block types they do not) dequantized."""
        in_blocks = {
            hf_name(t.name)
            for t in self.tensors
            if t.tensor_type.name in SUPPORTED_TYPES and t.tensor_type.name not in PLAIN_DTYPES
        }
        progress = self.path.stat().st_size >= PROGRESS_BYTES
        return self.mixed_weights(in_blocks.__contains__, progress=progress)


def read_gguf(path: Path) -> GGUFCheckpoint:
    """The GGUF file at `path`, its metadata checked and its tokenizer built."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path} as GGUF: {exc}") from None
    metadata = {name: field_value(field) for name, field in reader.fields.items()}
    if int(metadata.get("split.count") or 1) > 1:
        raise ModelLoadError(f"{path} is one part of a split GGUF file; merge it first")
    tensors = list(reader.tensors)
    check_tensors(tensors)
    hf = hf_config(metadata, {t.name: [int(n) for n in t.shape] for t in tensors})
    tokenizer = gguf_tokenizer(metadata, eos_token_ids=tuple(hf["eos_token_id"]))
    if tokenizer.vocab_size > hf["vocab_size"]:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, more than the "
            f"model's {hf['vocab_size']} embeddings"
        )
    return GGUFCheckpoint(
        path=path,
        hf_config=hf,
        dtype=file_dtype(tensors),
        tokenizer=tokenizer,
        chat_template=chat_template(metadata, path),
        tensors=tensors,
        row_orders=row_orders(hf, metadata["general.architecture"] in PERMUTED_ARCHITECTURES),
    )


def field_value(field: Any) -> Any:
    """A metadata field's value: a number, bool, string, or a list of them."""
    from gguf import GGUFValueType

    def one(part: Any, kind: Any) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        kind = field.types[-1]
        if kind not in (GGUFValueType.STRING, GGUFValueType.ARRAY) and field.data:
            return np.concatenate([field.parts[i] for i in field.data]).tolist()
        return [one(field.parts[i], kind) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def hf_config(metadata: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, Any]:
    """The Hugging Face `config.json` of the model the metadata (and the tensors'
    shapes, innermost dimension first) describe."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} (general.architecture) is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )

    def key(name: str) -> Any:
        value = metadata.get(f"{arch}.{name}")
        if value is None:
            raise ModelLoadError(f"the GGUF metadata lacks {arch}.{name}")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ModelLoadError(f"GGUF {arch}.{name} varies by layer, which is not supported")
            value = value[0]
        return value

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    rotary = metadata.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ModelLoadError(
            f"GGUF {arch}.rope.dimension_count is {rotary}, not the head size {head_dim}: "
            "partial rotary embeddings are not supported"
        )
    if "token_embd.weight" not in shapes:
        raise ModelLoadError("the GGUF file has no token_embd.weight")
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": shapes["token_embd.weight"][1],
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base") or 10_000.0),
        "rope_scaling": rope_scaling(metadata, arch),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": end_of_generation_ids(metadata),
    }
    if window := metadata.get(f"{arch}.attention.sliding_window"):
        hf["sliding_window"] = int(window)
    return hf


def rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type") or "none"
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise ModelLoadError(
        f"GGUF rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported; "
        "supported: none, linear"
    )


def end_of_generation_ids(metadata: dict[str, Any]) -> list[int]:
    """EOS, and the end-of-turn and end-of-message tokens llama.cpp also stops at."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [metadata.get(f"tokenizer.ggml.{key}") for key in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def file_dtype(tensors: list[Any]) -> str:
    """The dtype `dtype="auto"` serves the file in: its weights' float type, or
    bfloat16 where any weight is block-quantized (or the weights' types differ)."""
    kinds = {served_type(t) for t in tensors if len(t.shape) > 1}
    if len(kinds) == 1 and (kind := kinds.pop()) in PLAIN_DTYPES:
        return PLAIN_DTYPES[kind]
    return QUANTIZED_DTYPE


def chat_template(metadata: dict[str, Any], path: Path) -> str | None:
    """`tokenizer.chat_template`, checked to compile."""
    import jinja2

    template = metadata.get("tokenizer.chat_template")
    if template is None:
        return None
    try:
        compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ModelLoadError(f"{path}: the chat template does not compile: {exc}") from None
    return str(template)
