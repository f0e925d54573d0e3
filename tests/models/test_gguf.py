"""GGUF files (llama.cpp's format) on tiny models written by the tests.

The tiny HF checkpoints of tests/models/conftest.py, converted the way llama.cpp's
converter converts them (tests/models/gguf_files.py: renamed, q/k permuted for the
`llama` architecture, matrices in F32, F16, Q8_0, Q4_0 and Q4_1 in turn), load through
`load_model` with the logits `transformers` gives for the same weights as the file
holds them (each quantized and dequantized); each tensor dequantizes to what
`gguf.quants.dequantize` gives; each matrix kept quantized holds the blocks of the HF
weight's rows in HF's order; a file kvscope does not serve is refused naming why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

from kvscope.models.errors import ModelLoadError
from kvscope.models.gguf import read_gguf
from kvscope.models.loader import load_model

from .gguf_files import MIXED_TYPES, Q, byte_level_tokenizer, convert_checkpoint, write_gguf
from .test_parity import TEXTS, Cache, assert_close, hf_logits, prompts

CPU = torch.device("cpu")
#: The checkpoint kinds a GGUF file can hold, with the architecture it is written as
#: (llama.cpp writes Mistral as `llama`).
GGUF_KINDS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@pytest.fixture(scope="module")
def gguf_files(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`kind` → (its GGUF file, the weights the file holds in HF layout)."""
    root, built = tmp_path_factory.mktemp("gguf"), {}

    def get(kind: str) -> tuple[Path, dict[str, np.ndarray]]:
        if kind not in built:
            built[kind] = convert_checkpoint(
                checkpoints(kind), root / f"{kind}.gguf", arch=GGUF_KINDS[kind]
            )
        return built[kind]

    return get


def reference_model(checkpoints: Any, kind: str, weights: dict[str, np.ndarray]) -> Any:
    """`transformers`' model of `kind` with the weights the GGUF file holds."""
    import transformers

    hf = checkpoints.hf_model(kind)
    model = type(hf)(hf.config).eval()
    state = {name: torch.from_numpy(w) for name, w in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing)
    assert isinstance(model, transformers.PreTrainedModel)
    return model


@pytest.mark.parametrize("kind", list(GGUF_KINDS))
def test_logits_match_transformers_on_the_weights_the_file_holds(
    checkpoints: Any, gguf_files: Any, kind: str
) -> None:
    path, weights = gguf_files(kind)
    loaded = load_model(str(path), device=CPU, dtype="float32")
    hf = reference_model(checkpoints, kind, weights)
    assert loaded.config.architecture == GGUF_KINDS[kind]
    for ids in prompts(checkpoints(kind))[:2]:
        assert_close(Cache(loaded).step([(0, ids, 0)]), hf_logits(hf, ids))


def test_every_tensor_dequantizes_as_gguf_does(gguf_files: Any) -> None:
    """For a llama file, each tensor is `gguf.quants.dequantize` of the stored one with
    q/k rows put back: equal to the HF weight as the file's type holds it."""
    path, weights = gguf_files("llama")
    reader = GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    assert {t.tensor_type for t in reader.tensors} >= set(MIXED_TYPES)
    ours = read_gguf(path).weights()
    assert set(ours) == set(weights)
    for name, weight in ours.items():
        assert weight.dtype == torch.float32
        torch.testing.assert_close(weight, torch.from_numpy(weights[name]), rtol=0, atol=0)
    embed = stored["token_embd.weight"]
    direct = dequantize(embed.data, embed.tensor_type).reshape(
        ours["model.embed_tokens.weight"].shape
    )
    assert torch.equal(ours["model.embed_tokens.weight"], torch.from_numpy(direct))


def test_quantized_matrices_hold_the_rows_of_the_hf_weight(
    checkpoints: Any, tmp_path: Path
) -> None:
    """Kept quantized, q and k (permuted in the file) hold exactly the blocks of the HF
    weight quantized row by row, in HF's order."""
    from safetensors.numpy import load_file

    directory = checkpoints("llama")
    path, _ = convert_checkpoint(
        directory, tmp_path / "q41.gguf", arch="llama", qtype_of=lambda name: Q.Q4_1
    )
    hf = load_file(directory / "model.safetensors")
    quantized = read_gguf(path).quantized_weights()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        full = f"model.layers.1.self_attn.{name}.weight"
        weight = quantized[full]
        expected = quantize(hf[full].astype(np.float32), Q.Q4_1)
        assert weight.qtype == "Q4_1"
        assert weight.shape == hf[full].shape
        assert weight.data.dtype == torch.uint8
        assert np.array_equal(weight.data.numpy(), expected)
    assert "model.embed_tokens.weight" in quantized
    assert not any("norm" in name for name in quantized)


def test_mixed_weights_keep_the_chosen_matrices_quantized(gguf_files: Any) -> None:
    from kvscope.kernels.quantized import QuantizedWeight

    path, _ = gguf_files("llama")
    mixed = read_gguf(path).mixed_weights(lambda name: name.endswith("up_proj.weight"))
    kept = {name for name, w in mixed.items() if isinstance(w, QuantizedWeight)}
    assert kept == {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    assert all(isinstance(w, torch.Tensor) for n, w in mixed.items() if n not in kept)


def test_the_tokenizer_encodes_as_the_checkpoints_own(checkpoints: Any, gguf_files: Any) -> None:
    path, _ = gguf_files("qwen2")
    ours = load_model(str(path), device=CPU, dtype="float32").tokenizer
    theirs = load_model(str(checkpoints("qwen2")), device=CPU, dtype="float32").tokenizer
    texts = [*TEXTS, "<|im_start|>user\nhi<|im_end|>", "  two  spaces 123"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.encode("hi")[0] == ours.bos_token_id == theirs.bos_token_id
    assert len(ours.encode("<|im_start|>", add_special_tokens=False)) == 1
    assert ours.eos_token_ids == theirs.eos_token_ids


def test_a_directory_holding_one_gguf_file_loads(gguf_files: Any, tmp_path: Path) -> None:
    path, _ = gguf_files("qwen3")
    (tmp_path / path.name).symlink_to(path)
    loaded = load_model(str(tmp_path), device=CPU)
    assert loaded.config.qk_norm and loaded.name == path.name
    (tmp_path / "second.gguf").symlink_to(path)
    with pytest.raises(ModelLoadError, match="2 GGUF files"):
        load_model(str(tmp_path), device=CPU)
    with pytest.raises(ModelLoadError, match="no GGUF file"):
        load_model(str(tmp_path / "absent.gguf"), device=CPU)


def test_auto_dtype_is_the_files_float_or_bfloat16(checkpoints: Any, tmp_path: Path) -> None:
    directory = checkpoints("llama")
    for qtype, dtype in ((Q.F16, torch.float16), (Q.F32, torch.float32), (Q.Q8_0, torch.bfloat16)):
        path, _ = convert_checkpoint(
            directory, tmp_path / f"{qtype.name}.gguf", arch="llama", qtype_of=lambda n, q=qtype: q
        )
        assert load_model(str(path), device=CPU).model.dtype == dtype


def small_file(path: Path, checkpoints: Any, **changes: Any) -> Path:
    """The tiny llama checkpoint as a GGUF file, with `changes` to how it is written."""
    from safetensors.numpy import load_file

    directory = checkpoints("llama")
    config = json.loads((directory / "config.json").read_text())
    weights = {
        k: v.astype(np.float32) for k, v in load_file(directory / "model.safetensors").items()
    }
    tokenizer = byte_level_tokenizer(directory) | changes.pop("tokenizer", {})
    return write_gguf(
        path,
        arch=changes.pop("arch", "llama"),
        hf_config=config,
        weights=weights,
        tokenizer=tokenizer,
        qtype_of=lambda name: Q.F32,
        **changes,
    )


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"arch": "gpt2"}, "GGUF architecture 'gpt2'"),
        ({"tokenizer": {"ggml.model": "bert"}}, "GGUF tokenizer 'bert'"),
        ({"tokenizer": {"ggml.pre": "made-up"}}, "GGUF pre-tokenizer 'made-up'"),
        ({"metadata": {"llama.rope.scaling.type": "yarn"}}, "rope scaling 'yarn'"),
        (
            {"raw_tensors": {"blk.0.mystery.weight": (np.zeros(4, np.float32), Q.F32)}},
            "'blk.0.mystery.weight'",
        ),
        (
            {"raw_tensors": {"blk.0.ffn_gate.bias": (np.zeros((2, 292), np.uint8), Q.Q8_K)}},
            "type Q8_K",
        ),
    ],
    ids=["architecture", "tokenizer", "pre-tokenizer", "rope", "tensor", "tensor-type"],
)
def test_what_is_not_served_is_refused_by_name(
    checkpoints: Any, tmp_path: Path, changes: dict[str, Any], named: str
) -> None:
    path = small_file(tmp_path / "refused.gguf", checkpoints, **changes)
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        load_model(str(path), device=CPU)


def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused(
    gguf_files: Any, tmp_path: Path
) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read .* as GGUF"):
        load_model(str(path), device=CPU)
    whole, _ = gguf_files("llama")
    path.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cannot read .* as GGUF"):
        load_model(str(path), device=CPU)
