"""Loading a model by name: `tiny-random` (`tiny_random.py`), `bundled` (the checkpoint
shipped in `models/bundled`), a GGUF file or a directory holding one and no
`config.json` (`gguf.py`), or a Hugging Face checkpoint directory (`hf_checkpoint.py`).

`load_model` returns a `LoadedModel` (`loaded.py`): the decoder, its tokenizer, its
config and the generation defaults (`generation_defaults.py`); `served_as` gives it the
name, chat template and sampling defaults it is served with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from .chat import given_chat_template, read_chat_template
from .errors import ModelLoadError
from .generation_defaults import chosen_defaults, read_json
from .gguf import gguf_path, read_gguf
from .hf_checkpoint import ARCHITECTURES, load_checkpoint, load_tokenizer, model_config_from_hf
from .llama import LlamaModel
from .loaded import LoadedModel, resolve_dtype
from .lora import read_adapters
from .tiny_random import TINY_CONFIG, random_weights, tiny_random
from .tokenizer import ByteTokenizer, Tokenizer

#: What other modules import from here: the loaders' entry points and their types.
__all__ = [
    "ARCHITECTURES",
    "BUNDLED_DIR",
    "TINY_CONFIG",
    "LoadedModel",
    "ModelLoadError",
    "load_checkpoint",
    "load_gguf",
    "load_model",
    "random_weights",
    "served_as",
    "tiny_random",
    "tokenizer_of",
]

log = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).parent / "bundled"


def load_model(
    name: str,
    *,
    device: torch.device,
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    lora_modules: Sequence[tuple[str, str]] = (),
    max_lora_rank: int | None = None,
) -> LoadedModel:
    """The model `name` (`bundled`, `tiny-random` or a checkpoint directory), with the
    LoRA adapters of `lora_modules` read for it (`models/lora.py`)."""
    loaded = _load_base(name, device=device, dtype=dtype, seed=seed)
    loaded.model.adapters = read_adapters(
        lora_modules, loaded.config, device=device, max_rank=max_lora_rank
    )
    return loaded


def _load_base(
    name: str, *, device: torch.device, dtype: str | torch.dtype, seed: int
) -> LoadedModel:
    if name == "tiny-random":
        return tiny_random(device=device, dtype=resolve_dtype(dtype, "float32"), seed=seed)
    if name == "bundled":
        if not (BUNDLED_DIR / "config.json").is_file():
            raise ModelLoadError(f"the bundled model is missing from {BUNDLED_DIR}")
        return load_checkpoint(BUNDLED_DIR, device=device, dtype=dtype, name="bundled")
    path = Path(name)
    if (gguf_file := gguf_path(path)) is not None:
        return load_gguf(gguf_file, device=device, dtype=dtype)
    if not path.is_dir():
        raise ModelLoadError(
            f"model {name!r} is neither 'bundled', 'tiny-random' nor a checkpoint directory "
            "or GGUF file"
        )
    return load_checkpoint(path, device=device, dtype=dtype)


def tokenizer_of(name: str) -> tuple[Tokenizer, str | None]:
    """The tokenizer and chat template of the model `name` (as `load_model` takes it),
    without reading its weights: for clients that build prompts as token ids (the
    benchmarks' workloads)."""
    if name == "tiny-random":
        return ByteTokenizer(), None
    path = BUNDLED_DIR if name == "bundled" else Path(name)
    if (gguf_file := gguf_path(path)) is not None:
        gguf = read_gguf(gguf_file)
        return gguf.tokenizer, gguf.chat_template
    generation_path = path / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}
    tokenizer = load_tokenizer(
        path, model_config_from_hf(read_json(path / "config.json"), generation)
    )
    return tokenizer, read_chat_template(path, tokenizer.config)


def load_gguf(path: Path, *, device: torch.device, dtype: str | torch.dtype) -> LoadedModel:
    """A GGUF file (`models/gguf.py`): with `dtype="auto"` on a CPU, its block-quantized
    matrices stay quantized (the activations in bfloat16); otherwise, and for every
    other tensor, dequantized at load."""
    gguf = read_gguf(path)
    config = model_config_from_hf(gguf.hf_config, {})
    torch_dtype = resolve_dtype(dtype, gguf.dtype)
    quantized = dtype == "auto" and device.type == "cpu"
    how = "matrices kept quantized" if quantized else "dequantized"
    log.info("loading %s (%s) as %s, %s", path, config.architecture, torch_dtype, how)
    weights = gguf.served_weights() if quantized else gguf.weights()
    model = LlamaModel(config, weights, dtype=torch_dtype, device=device)
    return LoadedModel(
        name=path.name,
        model=model,
        tokenizer=gguf.tokenizer,
        config=config,
        chat_template=gguf.chat_template,
    )


def served_as(
    loaded: LoadedModel,
    *,
    name: str | None = None,
    chat_template: str | None = None,
    generation_config: str = "auto",
    override_generation_config: str | None = None,
) -> LoadedModel:
    """`loaded` under the name it is served as, with the chat template given (the
    template itself, or a file holding one; checked to compile) in place of its own,
    and its sampling defaults from `generation_config` with the override laid over
    (`EngineConfig`'s fields of these names)."""
    return attrs.evolve(
        loaded,
        name=name or loaded.name,
        chat_template=given_chat_template(chat_template) if chat_template else loaded.chat_template,
        generation_defaults=chosen_defaults(
            loaded.generation_defaults, generation_config, override_generation_config
        ),
    )
