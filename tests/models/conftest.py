"""Tiny random Hugging Face checkpoints, built with `transformers` once per session.

`checkpoint(kind)` saves a seeded random model of one architecture with
`save_pretrained`, beside a small byte-level BPE tokenizer trained by `tokenizers` on
a few English sentences (`tokenizer.json` + `tokenizer_config.json`). The kinds cover
every architecture the loader supports and both tied and untied embeddings:

| kind      | class               | what it exercises                         |
| --------- | ------------------- | ----------------------------------------- |
| llama     | LlamaForCausalLM    | plain rotary, untied lm_head              |
| llama3    | LlamaForCausalLM    | llama3 rope scaling, tied embeddings      |
| mistral   | MistralForCausalLM  | Mistral config, untied                    |
| qwen2     | Qwen2ForCausalLM    | q/k/v bias, tied embeddings               |
| qwen3     | Qwen3ForCausalLM    | q/k RMSNorm, untied                       |
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

KINDS = ("llama", "llama3", "mistral", "qwen2", "qwen3")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small model that wanted to speak English.",
    "A cache of keys and values makes decoding fast; cancelling a request frees it.",
    "Python is a programming language that lets you work quickly and integrate systems.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "In the beginning the universe was created. This has made a lot of people very angry.",
]

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    # Larger than the default 0.02 so the random model's logits are spread out and
    # greedy decoding is not decided by float rounding between near-ties.
    initializer_range=0.2,
)


def _configs() -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "llama": ("LlamaForCausalLM", dict(BASE, tie_word_embeddings=False, rope_theta=10_000.0)),
        "llama3": (
            "LlamaForCausalLM",
            dict(
                BASE,
                tie_word_embeddings=True,
                rope_theta=500_000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
        "mistral": (
            "MistralForCausalLM",
            dict(BASE, tie_word_embeddings=False, sliding_window=None),
        ),
        "qwen2": ("Qwen2ForCausalLM", dict(BASE, tie_word_embeddings=True)),
        "qwen3": ("Qwen3ForCausalLM", dict(BASE, tie_word_embeddings=False)),
    }


def train_tokenizer(directory: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE tokenizer with `<s>` prepended, saved as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 512,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_checkpoint(
    kind: str,
    directory: Path,
    *,
    seed: int | None = None,
    decoder_alone: bool = False,
    **save_kwargs: Any,
) -> Path:
    """Save a seeded random `kind` model and the test tokenizer into `directory`; with
    `decoder_alone`, its decoder without an output head (`Qwen3Model`, ...), as
    embedding models are saved."""
    class_name, kwargs = _configs()[kind]
    if decoder_alone:
        class_name = class_name.replace("ForCausalLM", "Model")
    train_tokenizer(directory)
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    model_class = getattr(transformers, class_name)
    config_class = model_class.config_class
    config = config_class(vocab_size=len(vocab), **kwargs)
    torch.manual_seed(KINDS.index(kind) if seed is None else seed)
    model = model_class(config).eval()
    if kind in ("qwen2", "qwen3"):
        # Freshly initialised norms are all ones and biases zero; make them count.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight", "_proj.bias")):
                    param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(directory, **save_kwargs)
    return directory


class CheckpointFactory:
    """Builds each kind once per session and hands out its directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}
        self._models: dict[str, Any] = {}

    def __call__(self, kind: str) -> Path:
        if kind not in self._built:
            self._built[kind] = build_checkpoint(kind, self.root / kind)
        return self._built[kind]

    def hf_model(self, kind: str) -> Any:
        """The checkpoint reloaded by `transformers` in float32, in eval mode."""
        if kind not in self._models:
            class_name, _ = _configs()[kind]
            model_class = getattr(transformers, class_name)
            self._models[kind] = model_class.from_pretrained(self(kind), dtype=torch.float32).eval()
        return self._models[kind]


@pytest.fixture(scope="session")
def open_engine(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """`open_engine` of tests/conftest.py (an engine that asserts nothing leaked on
    close), found among the loaded conftest plugins since both files are `conftest`."""
    root = Path(__file__).parent.parent / "conftest.py"
    for plugin in request.config.pluginmanager.get_plugins():
        if Path(getattr(plugin, "__file__", "") or "") == root:
            return plugin.open_engine
    raise LookupError(f"{root} is not loaded")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["kernel", "fallback"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Decode attention and the fused elementwise steps on the compiled CPU library,
    then torch's everywhere (what serves while the library builds, and where no
    compiler exists)."""
    from kvscope.kernels.attention import decode_backend
    from kvscope.kernels.cpu_decode import compiler, cpu_kernel

    if request.param == "fallback":
        monkeypatch.setenv("KVSCOPE_ATTENTION", "reference")
        for op in ("rms_norm_op", "silu_and_mul_op", "rope_and_cache_op"):
            monkeypatch.setattr(cpu_kernel(), op, None)
    elif compiler() is None:
        pytest.skip("no C++ compiler here: only the fallback runs")
    else:
        assert cpu_kernel().wait(timeout=900), cpu_kernel().why_not
    decode_backend.cache_clear()
    yield request.param
    decode_backend.cache_clear()
