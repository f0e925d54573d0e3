"""Loading a model by name: `tiny-random`, `bundled`, or a Hugging Face checkpoint dir.

`load_model` returns a `LoadedModel`: the decoder, its tokenizer, its config and the
generation defaults. A checkpoint directory holds `config.json`, `model.safetensors`
(or shards named by `model.safetensors.index.json`), `tokenizer.json`,
`tokenizer_config.json` and optionally `generation_config.json`. An unknown
architecture or a broken checkpoint raises `ModelLoadError` naming what is wrong.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from .config import ModelConfig
from .llama import LlamaModel
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).parent / "bundled"

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """The model named cannot be loaded; the message says why."""


@attrs.frozen(kw_only=True)
class LoadedModel:
    name: str
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    chat_template: str | None = None
    generation_defaults: dict[str, Any] = attrs.field(factory=dict)


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = checkpoint_dtype or "float32"
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use auto, float32 or bfloat16")
    return DTYPES[dtype]


def load_model(
    name: str, *, device: torch.device, dtype: str | torch.dtype = "auto", seed: int = 0
) -> LoadedModel:
    if name == "tiny-random":
        return tiny_random(device=device, dtype=resolve_dtype(dtype, "float32"), seed=seed)
    if name == "bundled":
        if not (BUNDLED_DIR / "config.json").is_file():
            raise ModelLoadError(f"the bundled model is missing from {BUNDLED_DIR}")
        return load_checkpoint(BUNDLED_DIR, device=device, dtype=dtype, name="bundled")
    path = Path(name)
    if not path.is_dir():
        raise ModelLoadError(
            f"model {name!r} is neither 'bundled', 'tiny-random' nor a checkpoint directory"
        )
    return load_checkpoint(path, device=device, dtype=dtype)


# -- tiny-random -----------------------------------------------------------------

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
    return LoadedModel(name="tiny-random", model=model, tokenizer=ByteTokenizer(), config=TINY_CONFIG)


# -- Hugging Face checkpoints -----------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path.parent} has no {path.name}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None


def model_config_from_hf(hf: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    architectures = hf.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or hf.get('model_type')!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    try:
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = generation.get("eos_token_id", hf.get("eos_token_id"))
        return ModelConfig(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10_000.0)),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=generation.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc.args[0]!r}") from None


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [directory / shard for shard in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{directory} lacks shard(s) {', '.join(missing)}")
    else:
        raise ModelLoadError(f"{directory} has no model.safetensors nor an index of shards")
    from tqdm import tqdm

    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc="loading weights", unit="file", disable=len(files) < 2):
        try:
            weights.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
    return weights


def load_checkpoint(
    directory: Path, *, device: torch.device, dtype: str | torch.dtype = "auto", name: str | None = None
) -> LoadedModel:
    hf = read_json(directory / "config.json")
    generation_path = directory / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}
    config = model_config_from_hf(hf, generation)
    torch_dtype = resolve_dtype(dtype, hf.get("torch_dtype") or hf.get("dtype"))
    tokenizer = HFTokenizer(directory, eos_token_ids=config.eos_token_ids)
    log.info("loading %s (%s) as %s", directory, config.architecture, torch_dtype)
    model = LlamaModel(config, read_safetensors(directory), dtype=torch_dtype, device=device)
    defaults = {k: generation[k] for k in ("temperature", "top_p", "top_k") if k in generation}
    return LoadedModel(
        name=name or directory.name,
        model=model,
        tokenizer=tokenizer,
        config=config,
        chat_template=tokenizer.chat_template,
        generation_defaults=defaults,
    )
