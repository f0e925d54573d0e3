"""What the benchmarks need to know about a GGUF model file, read from its header.

A benchmark's `--model` may be a GGUF file (llama.cpp's format, `kvscope serve` loads
it) or a short name for one (`smollm2`, `models/catalog.py`). `gguf_file` says which
file a model name is (the loader's own rule, `models.gguf.gguf_path`), `vocab_size`
how many token ids a prompt may use, and `weight_type` how the file holds its matrices
(`Q4_1`), for the tables. Only the header is read (the `gguf` package's reader maps the
file), never a tensor's data.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any


def resolve(model: str) -> str:
    """A short model name's file path (`smollm2`); any other name unchanged."""
    from kvscope.models.catalog import resolve_model

    return resolve_model(model)


def gguf_file(model: str) -> Path | None:
    """The GGUF file `model` names (a `.gguf` path, or a directory holding one and no
    `config.json`), or None."""
    if model in ("tiny-random", "bundled"):
        return None
    from kvscope.models.gguf import gguf_path

    return gguf_path(Path(model))


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def vocab_size(path: Path) -> int:
    """The token ids a prompt may hold: the embedding's rows, or the tokenizer's
    tokens where it has fewer (llama.cpp refuses an id its vocabulary lacks)."""
    reader = _reader(path)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rows = int(embedding.shape[1])  # GGUF lists the innermost dimension first
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return rows if tokens is None else min(rows, len(tokens.data))


def weight_type(path: Path) -> str:
    """How the file holds its weights: `general.file_type` (`Q4_1` for llama.cpp's
    MOSTLY_Q4_1), else the commonest type among its matrices."""
    from gguf import LlamaFileType

    reader = _reader(path)
    field = reader.fields.get("general.file_type")
    if field is not None:
        try:
            name = LlamaFileType(int(field.parts[field.data[0]][0])).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass  # a file type newer than this gguf package: count the tensors
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return kinds.most_common(1)[0][0] if kinds else "unknown"


def served_weights(file_weights: str | None, dtype: str) -> str | None:
    """How `kvscope serve --dtype dtype` holds the weights of a GGUF file whose
    weights are `file_weights` (`weight_type`): under `auto` as the file holds them,
    else dequantized to `dtype`; None where the model is no GGUF file."""
    if file_weights is None:
        return None
    return file_weights if dtype == "auto" else dtype
