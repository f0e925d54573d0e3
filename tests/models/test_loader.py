"""Loading Hugging Face checkpoints: sharded ones (with a progress bar), the tokenizer
matching transformers', and every kind of broken checkpoint raising `ModelLoadError`
with a message that names what is wrong."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvscope.kernels.cpu_decode import cpu_kernel
from kvscope.models.errors import ModelLoadError
from kvscope.models.loader import load_model

from .conftest import build_checkpoint
from .test_parity import Cache

CPU = torch.device("cpu")


def load(path: Path, **kwargs: Any) -> Any:
    return load_model(str(path), device=CPU, dtype="float32", **kwargs)


@pytest.fixture
def broken(checkpoints: Any, tmp_path: Path) -> Path:
    """A private copy of the llama checkpoint, to break."""
    target = tmp_path / "broken"
    shutil.copytree(checkpoints("llama"), target)
    return target


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_weights(directory: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    weights = load_file(str(directory / "model.safetensors"))
    change(weights)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def logits_of(loaded: Any, ids: list[int]) -> torch.Tensor:
    return Cache(loaded).step([(0, ids, 0)])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen2", tmp_path_factory.mktemp("sharded"), max_shard_size="40KB")


def test_sharded_checkpoint_loads_with_progress(
    sharded: Path, checkpoints: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert not (sharded / "model.safetensors").exists()
    # Both forwards on the same ops: the compiled library, once built or given up, never
    # taking over between them (or inside the first).
    cpu_kernel().wait(900)
    loaded = load(sharded)
    assert "loading sharded" in capfd.readouterr().err  # tqdm's bar, on stderr
    ids = loaded.tokenizer.encode("The quick brown fox")
    assert torch.equal(logits_of(loaded, ids), logits_of(load(checkpoints("qwen2")), ids))


def test_single_small_file_shows_no_progress(
    checkpoints: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    load(checkpoints("llama"))
    assert "loading" not in capfd.readouterr().err


def test_missing_shard_is_named(sharded: Path, tmp_path: Path) -> None:
    target = tmp_path / "sharded"
    shutil.copytree(sharded, target)
    shard = sorted(target.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"lacks shard.*{shard.name}"):
        load(target)


def test_tokenizer_matches_transformers(checkpoints: Any) -> None:
    from transformers import AutoTokenizer

    directory = checkpoints("llama")
    ours = load(directory).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(directory))
    for text in [
        "Once upon a time",
        "  two spaces, émigré ünïcode 🙂",
        "<s> inline special </s> end",
    ]:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == theirs.bos_token_id == 0
    assert ours.eos_token_ids == (1,)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
            "unsupported architecture.*GPT2LMHeadModel",
        ),
        (lambda c: c.pop("hidden_size"), "lacks 'hidden_size'"),
        (lambda c: c.update(num_hidden_layers="two"), "malformed value"),
        (lambda c: c.update(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
        (
            lambda c: c.update(
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
            ),
            "'yarn' is not supported",
        ),
        (lambda c: c.update(mlp_bias=True), "mlp_bias"),
        (
            lambda c: c.update(intermediate_size=96),
            r"mlp.gate_proj.weight' has shape \(128, 64\), but config.json implies \(96, 64\)",
        ),
        (
            lambda c: c.update(vocab_size=100),
            "tokenizer has 384 tokens, more than the model's vocab_size of 100",
        ),
    ],
    ids=["architecture", "missing-key", "bad-value", "heads", "rope", "mlp-bias", "shape", "vocab"],
)
def test_bad_config_is_named(
    broken: Path, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    edit_json(broken / "config.json", change)
    with pytest.raises(ModelLoadError, match=message):
        load(broken)


def test_architecture_from_model_type_when_architectures_is_absent(broken: Path) -> None:
    edit_json(broken / "config.json", lambda c: c.pop("architectures"))
    assert load(broken).config.architecture == "llama"


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), "holds a JSON list"),
        (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors"),
        (
            lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
            "pickle weights only",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes(
                (d / "model.safetensors").read_bytes()[:5000]
            ),
            "cannot read .*model.safetensors",
        ),
        (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
        (lambda d: (d / "tokenizer.json").write_text('{"model": 3}'), "cannot read the tokenizer"),
        (
            lambda d: (d / "chat_template.jinja").write_text("{% if %}"),
            "chat template does not compile",
        ),
    ],
    ids=[
        "no-config",
        "bad-json",
        "json-list",
        "no-weights",
        "pickle",
        "truncated",
        "no-tokenizer",
        "bad-tokenizer",
        "bad-template",
    ],
)
def test_broken_files_are_named(
    broken: Path, breakage: Callable[[Path], Any], message: str
) -> None:
    breakage(broken)
    with pytest.raises(ModelLoadError, match=message):
        load(broken)


def test_missing_tensor_is_named(broken: Path) -> None:
    edit_weights(broken, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        ModelLoadError, match=r"missing 1 tensor\(s\): model.layers.1.self_attn.k_proj.weight"
    ):
        load(broken)


def test_misshapen_tensor_is_named(broken: Path) -> None:
    edit_weights(broken, lambda w: w.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(
        ModelLoadError,
        match=r"'model.norm.weight' has shape \(65,\), but config.json implies \(64,\)",
    ):
        load(broken)


def test_untied_checkpoint_without_lm_head_is_refused(broken: Path) -> None:
    edit_weights(broken, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load(broken)


def test_extra_tensors_are_ignored_with_a_warning(
    broken: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edit_weights(
        broken, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    )
    with caplog.at_level(logging.WARNING, logger="kvscope.models.loader"):
        load(broken)
    assert "rotary_emb.inv_freq" in caplog.text


def test_unknown_model_name() -> None:
    with pytest.raises(ModelLoadError, match="neither 'bundled', 'tiny-random' nor a checkpoint"):
        load_model("/no/such/dir", device=CPU)


def test_sliding_window_caps_the_context(broken: Path) -> None:
    edit_json(
        broken / "config.json",
        lambda c: c.update(
            architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128
        ),
    )
    assert load(broken).config.max_position_embeddings == 128


def test_generation_config_supplies_eos_and_defaults(broken: Path) -> None:
    (broken / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [1, 4], "temperature": 0.7, "top_p": 0.9})
    )
    loaded = load(broken)
    assert loaded.config.eos_token_ids == (1, 4)
    assert loaded.tokenizer.eos_token_ids == (1, 4)
    assert loaded.generation_defaults == {"temperature": 0.7, "top_p": 0.9}


@pytest.mark.anyio
async def test_the_checkpoints_generation_defaults_fill_in_unset_sampling_fields(
    broken: Path, open_engine: Any, anyio_backend: str
) -> None:
    (broken / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    async with open_engine(str(broken)) as engine:
        greedy = await engine.generate("defaults", max_tokens=12, temperature=0, ignore_eos=True)
        defaulted = await engine.generate("defaults", max_tokens=12, ignore_eos=True)
        assert defaulted.token_ids == greedy.token_ids
        hot = await engine.generate(
            "defaults", max_tokens=12, temperature=1.5, seed=1, ignore_eos=True
        )
        assert hot.token_ids != greedy.token_ids  # an explicit value still wins


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_generation_defaults_apply_over_http_too(
    broken: Path, tmp_path: Path, backend: str
) -> None:
    from tests.web.conftest import running_server, wait_status

    (broken / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    body = {"prompt": "defaults", "max_tokens": 12, "ignore_eos": True}
    with running_server(backend, tmp_path, model=str(broken)) as live, live.client() as client:

        def tokens(extra: dict[str, Any]) -> tuple[int, ...]:
            job = client.post("/generate", json={**body, **extra}).json()["id"]
            return tuple(wait_status(client, job)["token_ids"])

        greedy = tokens({"temperature": 0})
        # Unset, the temperature is the checkpoint's 0: greedy, whatever the seed.
        assert [tokens({"seed": seed}) for seed in (1, 2)] == [greedy, greedy]
        assert tokens({"temperature": 1.5, "seed": 1}) != greedy  # a given value wins

        def completion(extra: dict[str, Any]) -> str:
            response = client.post("/v1/completions", json={**body, **extra})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        # The OpenAI route too: unset, greedy whatever the seed; given, the value wins.
        openai_greedy = completion({"temperature": 0})
        assert [completion({"seed": seed}) for seed in (1, 2)] == [openai_greedy] * 2
        assert completion({"temperature": 1.5, "seed": 1}) != openai_greedy
