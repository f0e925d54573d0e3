"""What the model names in vLLM's tests resolve to: SmolLM2, offline (docs/vllm-tests.md).

vLLM's test files name their own checkpoints (`Qwen/Qwen3-0.6B`, `facebook/opt-125m`,
...), for the server and for the tokenizers the tests load themselves. `hf_home` writes
a Hugging Face home whose hub cache holds each of those names as a snapshot of the
SmolLM2 directory (links to its files), so that with the hub offline every
`from_pretrained(name)` and `vllm serve name` reads SmolLM2, as the tests' own code
does, unchanged. `lora_adapter` writes the adapter the LoRA fixtures get: a PEFT
adapter of SmolLM2 whose `lora_B` is zero, so the adapted model answers as the base.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

#: A model name assigned in a test file (`MODEL_NAME = "org/name"`, `model_name = ...`)
#: or given to the server launcher as a literal (`RemoteOpenAIServer("org/name", ...)`).
MODEL_NAME_PATTERN = re.compile(
    r'^\s*\w*(?:MODEL|model)\w*\s*=\s*"([\w.-]+/[\w.-]+)"'
    r'|RemoteOpenAIServer\(\s*"([\w.-]+/[\w.-]+)"',
    re.MULTILINE,
)

#: The commit every linked snapshot claims to be (the hub cache wants one).
SNAPSHOT = "0" * 40

#: The checkpoint's files the adapter's directory carries (its tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

#: The adapter's rank and the projections it adapts.
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


def model_names(test_files: Iterable[Path]) -> list[str]:
    """The Hugging Face model names the test files use, sorted."""
    names = set()
    for path in test_files:
        for match in MODEL_NAME_PATTERN.finditer(path.read_text()):
            names.add(match.group(1) or match.group(2))
    return sorted(names)


def hf_home(home: Path, names: Iterable[str], checkpoint: Path) -> Path:
    """Write `home` as a Hugging Face home where each of `names` is `checkpoint`; `home`.
    A name already linked to `checkpoint` is left as it is (a run may be reading it)."""
    for name in names:
        repo = home / "hub" / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / SNAPSHOT
        if (snapshot / "config.json").resolve() == (checkpoint / "config.json").resolve():
            continue
        if repo.exists():
            shutil.rmtree(repo)
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(SNAPSHOT)
        for file in sorted(checkpoint.iterdir()):
            if file.is_file():
                (snapshot / file.name).symlink_to(file.resolve())
    return home


def lora_adapter(out: Path, checkpoint: Path) -> Path:
    """Write `out` as a PEFT LoRA adapter of `checkpoint` with zero `lora_B`; `out`."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((checkpoint / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_features = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in LORA_TARGETS:
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = torch.randn(LORA_RANK, hidden, generator=generator) / hidden**0.5
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = torch.zeros(
                out_features[proj], LORA_RANK, dtype=torch.bfloat16
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(checkpoint),
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    # Adapters on the hub carry their tokenizer, and tests load it from the adapter's path.
    for name in TOKENIZER_FILES:
        if (checkpoint / name).is_file() and not (out / name).exists():
            (out / name).symlink_to((checkpoint / name).resolve())
    return out
