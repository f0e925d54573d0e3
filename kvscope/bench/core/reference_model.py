"""The benchmarks' reference model: a ~32 M-parameter Llama with seeded random weights.

Hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408, vocabulary 8000, 4096
positions, bfloat16, and a byte-level BPE tokenizer trained with `tokenizers` on text
that ships with Python (`pydoc_data.topics`), so it builds offline. It is saved with
`transformers`' `save_pretrained`, so kvscope, `transformers` and vLLM all load the
same directory. `ensure_reference_model` builds it on first use.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_DIR = Path(
    os.environ.get("KVSCOPE_REFERENCE_MODEL", "~/.cache/kvscope/reference-llama")
).expanduser()

SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "vocab_size": 8000,
    "max_position_embeddings": 4096,
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def training_text(limit: int | None = None) -> list[str]:
    """Offline English and Python text: the help topics that ship with CPython."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)[:limit]]


def build_tokenizer(
    vocab_size: int, text_limit: int | None = None
):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(text_limit), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_reference_model(
    directory: Path,
    *,
    seed: int = 0,
    shape: dict[str, int] | None = None,
    text_limit: int | None = None,
) -> Path:
    """Write the reference checkpoint (config, safetensors, tokenizer) to `directory`.

    `shape` overrides the model's sizes and `text_limit` the tokenizer's training text
    (the tests build a tiny checkpoint this way)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory = Path(directory).expanduser()
    sizes: dict[str, Any] = {**SHAPE, **(shape or {})}
    tokenizer = build_tokenizer(sizes["vocab_size"], text_limit)
    config = LlamaConfig(
        **sizes,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    tmp = directory.with_name(directory.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if directory.exists():
        import shutil

        shutil.rmtree(directory)
    tmp.rename(directory)
    params = sum(p.numel() for p in model.parameters())
    log.info("built the reference Llama (%.1f M parameters) in %s", params / 1e6, directory)
    return directory


def ensure_reference_model(directory: Path | str | None = None) -> Path:
    """The reference model's directory, built there first if it is missing."""
    path = Path(directory).expanduser() if directory else DEFAULT_DIR
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        print(f"building the reference model in {path} (once) ...", flush=True)
        build_reference_model(path)
    return path
