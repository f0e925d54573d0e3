"""`kvscope bench convert FILE.gguf OUT_DIR`: a GGUF file as a Hugging Face checkpoint.

vLLM and `transformers` serve a Hugging Face directory, not a GGUF file; to run them on
the weights that `kvscope serve` and llama.cpp serve from the file, `bench throughput`
takes that directory as `--peer-model`. `convert_gguf` writes it with transformers' own
GGUF loader (every tensor dequantized, saved as bfloat16 safetensors) and its GGUF
tokenizer, so the conversion is transformers', not kvscope's. The model name may be a
short name (`smollm2`, `models/catalog.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .core import gguf_model

#: The dtype the directory's weights are saved in (vLLM's CPU build serves bfloat16).
CONVERTED_DTYPE = "bfloat16"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf", help="a GGUF file (or a short name for one: smollm2)")
    p.add_argument("out", type=Path, help="the directory to write (created)")
    p.add_argument("--dtype", default=CONVERTED_DTYPE, choices=["bfloat16", "float32"])


def convert_gguf(model: str, out: Path, *, dtype: str = CONVERTED_DTYPE) -> Path:
    """Write the GGUF file `model` names as a Hugging Face checkpoint in `out` (its
    config, `dtype` safetensors, generation config and tokenizer); `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    file = gguf_model.gguf_file(gguf_model.resolve(model))
    if file is None:
        raise ValueError(f"{model} is not a GGUF file")
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    # Unpacked at load (transformers would otherwise keep the blocks, which it cannot
    # save); the model then holds plain tensors, so its quantization record goes too.
    loaded = AutoModelForCausalLM.from_pretrained(
        str(file.parent),
        gguf_file=file.name,
        dtype=torch_dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    if (quantizer := getattr(loaded, "hf_quantizer", None)) is not None:
        quantizer.remove_quantization_config(loaded)
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    out.mkdir(parents=True, exist_ok=True)
    loaded.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run(args: argparse.Namespace) -> int:
    from kvscope.models.errors import ModelLoadError

    try:
        out = convert_gguf(args.gguf, args.out, dtype=args.dtype)
    except (ValueError, ModelLoadError, OSError) as exc:
        print(f"kvscope bench convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (from {args.gguf}, {args.dtype}); pass it as --peer-model")
    return 0
