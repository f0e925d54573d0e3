"""Loading a model by name: `tiny-random`, `bundled`, or a Hugging Face checkpoint dir.

`load_model` returns a `LoadedModel`: the decoder, its tokenizer, its config and the
generation defaults. A GGUF file (or a directory holding one and no `config.json`) is
read by `models/gguf.py`. A checkpoint directory holds `config.json`, `model.safetensors`
(or shards named by `model.safetensors.index.json`), `tokenizer.json`,
`tokenizer_config.json` and optionally `generation_config.json`. An unknown
architecture or a broken checkpoint (a missing or unreadable file, a missing tensor, a
tensor whose shape disagrees with `config.json`) raises `ModelLoadError` naming what is
wrong, before the weights are copied to the device. Loading a large or sharded
checkpoint shows a progress bar (tqdm, on stderr) over the bytes read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURES", "LoadedModel", "ModelLoadError", "load_model"]

import attrs
import torch

from kvscope.kernels.rope import SUPPORTED_ROPE_TYPES, rope_type
from kvscope.params import SamplingParams

from .chat import (
    ChatTemplateError,
    given_chat_template,
    read_chat_template,
    render_chat,
    special_tokens,
)
from .config import ModelConfig
from .errors import ModelLoadError
from .gguf import gguf_path, read_gguf
from .llama import LlamaModel
from .lora import read_adapters
from .sentence_pooling import sentence_transformers_pooling
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from .weights import check_weights

log = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).parent / "bundled"

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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen(kw_only=True)
class LoadedModel:
    name: str
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    chat_template: str | None = None
    generation_defaults: dict[str, Any] = attrs.field(factory=dict)
    #: False for a checkpoint without an output head (an embedding model's decoder):
    #: it answers embeddings only.
    generates: bool = True
    #: Why this model's embeddings would not be kvscope's (the last token's hidden
    #: state, normalized), as its sentence-transformers modules say; None if they are.
    embeddings_differ: str | None = None

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The chat as the model's template renders it, with its special tokens."""
        if self.chat_template is None:
            raise ChatTemplateError(f"model {self.name!r} has no chat template")
        tokens = special_tokens(getattr(self.tokenizer, "config", {}))
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**tokens, **extra},
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """The token ids of the rendered chat (its special tokens come from the template)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.tokenizer.encode(text, add_special_tokens=False)


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = checkpoint_dtype or "float32"
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use auto, float32 or bfloat16")
    return DTYPES[dtype]


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


def chosen_defaults(own: dict[str, Any], source: str, override: str | None) -> dict[str, Any]:
    """The sampling defaults: the checkpoint's `own` (`auto`), none (`vllm`), or a
    directory's generation_config.json's; then `override`'s (JSON) laid over."""
    if source == "auto":
        defaults = dict(own)
    elif source == "vllm":
        defaults = {}
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ModelLoadError(f"generation_config: {source} holds no generation_config.json")
        defaults = generation_defaults(read_json(path))
    if override:
        try:
            extra = json.loads(override)
        except ValueError as exc:
            raise ModelLoadError(f"override_generation_config is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ModelLoadError("override_generation_config must be a JSON object")
        unknown = sorted(set(extra) - set(GENERATION_DEFAULTED))
        if unknown:
            raise ModelLoadError(
                f"override_generation_config sets {unknown[0]}; it takes "
                f"{', '.join(GENERATION_DEFAULTED)}"
            )
        defaults |= extra
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"the sampling defaults are invalid: {exc}") from None
    return defaults


def generation_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """What a generation_config.json sets of the sampling defaults."""
    return {k: generation[k] for k in GENERATION_DEFAULTED if k in generation}


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
    return LoadedModel(
        name="tiny-random", model=model, tokenizer=ByteTokenizer(), config=TINY_CONFIG
    )


# -- Hugging Face checkpoints -----------------------------------------------------

#: Show a progress bar when the weights total at least this many bytes (or are sharded).
PROGRESS_BYTES = 256 * 2**20

#: The sampling fields a checkpoint's generation_config.json gives defaults for: they
#: fill in what a request leaves unset, on every route.
GENERATION_DEFAULTED = ("temperature", "top_p", "top_k", "min_p")

MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path.parent} has no {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


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
