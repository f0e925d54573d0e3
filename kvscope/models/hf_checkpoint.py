"""A Hugging Face checkpoint directory: `config.json`, `model.safetensors` (or shards
named by `model.safetensors.index.json`), `tokenizer.json`, `tokenizer_config.json` and
optionally `generation_config.json`. An unknown architecture or a broken checkpoint (a
missing or unreadable file, a missing tensor, a tensor whose shape disagrees with
`config.json`) raises `ModelLoadError` naming what is wrong, before the weights are
copied to the device. Loading a large or sharded checkpoint shows a progress bar (tqdm,
on stderr) over the bytes read. `model_config_from_hf` also reads a GGUF file's
translated config (`gguf.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from kvscope.kernels.rope import SUPPORTED_ROPE_TYPES, rope_type

from .chat import read_chat_template
from .config import ModelConfig
from .errors import ModelLoadError
from .generation_defaults import generation_defaults, read_json
from .llama import LlamaModel
from .loaded import LoadedModel, resolve_dtype
from .sentence_pooling import sentence_transformers_pooling
from .tokenizer import HFTokenizer
from .weights import check_weights

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # The decoders alone, as embedding models are saved (e5-mistral, gte-Qwen2,
    # Qwen3-Embedding): their tensors are named without `model.`, and may have no
    # output head (`LoadedModel.generates`).
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
#: The prefix of the decoder's tensors in a `...ForCausalLM` checkpoint.
DECODER_PREFIX = "model."
#: Show a progress bar when the weights total at least this many bytes (or are sharded).
PROGRESS_BYTES = 256 * 2**20
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def architecture_of(hf: dict[str, Any]) -> str:
    architectures = hf.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
    if arch is None and not architectures:
        arch = MODEL_TYPES.get(hf.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or hf.get('model_type')!r} in config.json; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def model_config_from_hf(hf: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    """The decoder's `ModelConfig` from `config.json` (transformers 4 or 5 layout)."""
    arch = architecture_of(hf)
    if hf.get("mlp_bias"):
        raise ModelLoadError("config.json sets mlp_bias, which kvscope does not support")
    try:
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        hidden = int(hf["hidden_size"])
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope_type(rope) != "default" else None)
        eos = generation.get("eos_token_id", hf.get("eos_token_id"))
        max_positions = int(hf.get("max_position_embeddings", 2048))
        config = ModelConfig(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
            rope_scaling=scaling,
            max_position_embeddings=_attended_positions(hf, arch, max_positions),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=generation.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json has a malformed value: {exc}") from None
    if heads % kv_heads:
        raise ModelLoadError(
            f"config.json: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope scaling {kind!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return config


def _attended_positions(hf: dict[str, Any], arch: str, max_positions: int) -> int:
    """Cap the context at a sliding window, within which full attention is exact."""
    window = hf.get("sliding_window")
    if arch == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if window and window < max_positions:
        log.warning("sliding window of %d tokens: capping the context to it", window)
        return int(window)
    return max_positions


def weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [directory / shard for shard in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{directory} lacks shard(s) named in its index: {', '.join(missing)}"
            )
        return files
    if list(directory.glob("*.bin")) or list(directory.glob("*.pt")):
        raise ModelLoadError(
            f"{directory} holds PyTorch pickle weights only; kvscope reads safetensors "
            "(convert with save_pretrained(..., safe_serialization=True))"
        )
    raise ModelLoadError(f"{directory} has no model.safetensors nor model.safetensors.index.json")


def read_safetensors(directory: Path, *, progress: bool | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, on the CPU, with a progress bar over the bytes
    read when the checkpoint is sharded or large (`progress=None`) or when asked."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = weight_files(directory)
    total = sum(f.stat().st_size for f in files)
    if progress is None:
        progress = len(files) > 1 or total >= PROGRESS_BYTES
    weights: dict[str, torch.Tensor] = {}
    with tqdm(
        total=total,
        desc=f"loading {directory.name}",
        unit="B",
        unit_scale=True,
        disable=not progress,
    ) as bar:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                        tensor = handle.get_tensor(name)
                        weights[name] = tensor
                        bar.update(tensor.numel() * tensor.element_size())
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read {file}: {exc}") from None
    return weights


def load_tokenizer(directory: Path, config: ModelConfig) -> HFTokenizer:
    try:
        tokenizer = HFTokenizer(directory, eos_token_ids=config.eos_token_ids)
    except FileNotFoundError as exc:
        raise ModelLoadError(str(exc)) from None
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelLoadError(f"cannot read the tokenizer in {directory}: {exc}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
            f"vocab_size of {config.vocab_size}"
        )
    return tokenizer


def load_checkpoint(
    directory: Path,
    *,
    device: torch.device,
    dtype: str | torch.dtype = "auto",
    name: str | None = None,
    progress: bool | None = None,
) -> LoadedModel:
    hf = read_json(directory / "config.json")
    generation_path = directory / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}
    config = model_config_from_hf(hf, generation)
    torch_dtype = resolve_dtype(dtype, hf.get("dtype") or hf.get("torch_dtype"))
    tokenizer = load_tokenizer(directory, config)
    log.info("loading %s (%s) as %s", directory, config.architecture, torch_dtype)
    weights = decoder_weights(read_safetensors(directory, progress=progress))
    # Only a decoder saved alone may lack the head; a `...ForCausalLM` without one is
    # a broken checkpoint, refused below.
    alone = any(a.endswith("Model") for a in hf.get("architectures") or [])
    generates = config.tie_word_embeddings or "lm_head.weight" in weights or not alone
    if not generates:
        log.info("%s has no output head: it answers embeddings only", directory)
        config = attrs.evolve(config, tie_word_embeddings=True)  # a head never used
    unused = check_weights(config, weights)
    if unused:
        log.warning(
            "%s: ignoring %d tensor(s) the decoder does not use, e.g. %s",
            directory,
            len(unused),
            unused[0],
        )
    model = LlamaModel(config, weights, dtype=torch_dtype, device=device)
    defaults = generation_defaults(generation)
    differ = sentence_transformers_pooling(directory)
    if differ is not None:
        log.warning("%s: its embeddings will be refused: %s", directory, differ)
    return LoadedModel(
        name=name or directory.name,
        model=model,
        tokenizer=tokenizer,
        config=config,
        chat_template=read_chat_template(directory, tokenizer.config),
        generation_defaults=defaults,
        generates=generates,
        embeddings_differ=differ,
    )


def decoder_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors named as in a `...ForCausalLM` checkpoint: a decoder saved alone
    (an embedding model's) names its own without `model.`."""
    if DECODER_PREFIX + "embed_tokens.weight" in weights or "embed_tokens.weight" not in weights:
        return weights
    return {
        name if name == "lm_head.weight" else DECODER_PREFIX + name: tensor
        for name, tensor in weights.items()
    }
