"""`kvscope bench vllm-tests`: the parts that adapt vLLM's tests (the launch's flags, the
file selection, the sdist's checksum and unpacking, the model names' resolution, the
LoRA adapter, the JUnit reading), on small inputs; and one real run of one of vLLM's
tests against `kvscope serve` where vLLM's virtualenv and the sdist are here."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import kvscope
from kvscope.bench.vllm_tests import models, results, sdist, selection
from kvscope.bench.vllm_tests.pytest_plugin import kvscope_argv, reaches_server, split_flags

ACCEPTED: dict[str, list[str] | None] = {
    "--max-model-len": None,
    "--enforce-eager": None,
    "--lora-modules": None,
    "--port": None,
    "--seed": None,
    "--dtype": ["auto", "bfloat16"],
}


def test_split_flags_keeps_what_kvscope_takes_with_its_values() -> None:
    args = ["--max_model_len", "2048", "--enforce-eager", "--root-path", "/llm"]
    args += ["--lora-modules", "a=/x", "b=/y", "--hf-overrides={}", "--seed", "-1"]
    kept, dropped = split_flags(args + ["--dtype", "float16"], ACCEPTED)
    assert (
        " ".join(kept) == "--max-model-len 2048 --enforce-eager --lora-modules a=/x b=/y --seed -1"
    )
    assert dropped == ["--root-path", "/llm", "--hf-overrides", "{}", "--dtype", "float16"]
    assert split_flags(["--dtype=bfloat16"], ACCEPTED) == (["--dtype", "bfloat16"], [])


def test_kvscope_argv_serves_the_tests_model_name() -> None:
    settings = {
        "accepted_flags": ACCEPTED | {"--served-model-name": None},
        "serve": ["python", "-m", "kvscope.cli", "serve"],
        "kvscope_model": "smollm2",
        "kvscope_args": ["--worker", "thread"],
    }
    argv, dropped = kvscope_argv(settings, "Qwen/Qwen3-0.6B", ["--port", "8000", "--dtype", "half"])
    served = "--port 8000 --served-model-name Qwen/Qwen3-0.6B --worker thread"
    assert " ".join(argv) == f"python -m kvscope.cli serve smollm2 {served}"
    assert dropped == ["--dtype", "half"]
    named, _ = kvscope_argv(settings, "m", ["--served-model-name", "other"])
    assert named.count("--served-model-name") == 1 and "other" in named


def test_reaches_server_by_fixture_or_by_starting_one() -> None:
    assert reaches_server(["client", "model_name"], "")
    assert reaches_server(["server_with_store"], "")
    assert reaches_server([], "with RemoteOpenAIServer(m, args) as s:")
    assert not reaches_server(["monkeypatch"], "ChatCompletionRequest(...)")


def fake_tree(root: Path, files: list[str]) -> Path:
    for name in files:
        path = root / selection.OPENAI_TESTS / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('MODEL_NAME = "org/model-a"\n')
    return root


def test_select_names_paths_and_refuses_missing_files(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, ["models/test_models.py", "test_new.py"])
    chosen = selection.select(root, ["models/test_models.py::test_check_models"])
    assert chosen == ["tests/entrypoints/openai/models/test_models.py::test_check_models"]
    with pytest.raises(ValueError, match="test_chat.py"):
        selection.select(root, ["chat_completion/test_chat.py"])
    with pytest.raises(ValueError):
        selection.select(root)  # the default set is not in this tree
    assert selection.unlisted(root) == ["test_new.py"]


def test_every_default_file_is_not_also_skipped() -> None:
    assert not {selection.file_of(e) for e in selection.DEFAULT} & set(selection.SKIPPED)


def tarball(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_fetch_checks_the_sha256_and_keeps_only_a_good_copy(tmp_path: Path) -> None:
    source = tarball(tmp_path / "v-1.tar.gz", {"v-1/tests/test_a.py": b"x"})
    good = hashlib.sha256(source.read_bytes()).hexdigest()
    cache = tmp_path / "cache"
    with pytest.raises(sdist.ChecksumError, match=good):
        sdist.fetch(cache, source.as_uri(), "0" * 64)
    assert list(cache.iterdir()) == []
    assert sdist.fetch(cache, source.as_uri(), good) == cache / "v-1.tar.gz"
    (cache / "v-1.tar.gz").write_bytes(b"changed")
    with pytest.raises(sdist.ChecksumError):
        sdist.fetch(cache, source.as_uri(), good)  # the cached copy is checked again


def test_extract_unpacks_the_tests_and_pytest_settings_only(tmp_path: Path) -> None:
    members = {"v-1/tests/utils.py": b"u", "v-1/pyproject.toml": b"p", "v-1/vllm/x.py": b"v"}
    archive = tarball(tmp_path / "v-1.tar.gz", members)
    root = sdist.extract(archive, tmp_path / "out")
    assert root == tmp_path / "out" / "v-1"
    assert (root / "tests" / "utils.py").read_text() == "u"
    assert (root / "pyproject.toml").is_file() and not (root / "vllm").exists()
    (root / "tests" / "utils.py").write_text("kept")
    sdist.extract(archive, tmp_path / "out")  # once: a second call leaves the tree
    assert (root / "tests" / "utils.py").read_text() == "kept"


def test_model_names_resolve_offline_to_the_checkpoint(tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    tests = tmp_path / "test_x.py"
    code = 'MODEL_NAME = "org/a"\nRemoteOpenAIServer("org/b", [])\nx = "not/a-model"\n'
    tests.write_text(code + 'def test():\n    model_name = "org/c"\n')
    names = models.model_names([tests])
    assert names == ["org/a", "org/b", "org/c"]
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    home = models.hf_home(tmp_path / "home", names, checkpoint)
    for name in names:
        found = snapshot_download(name, cache_dir=home / "hub", local_files_only=True)
        assert (Path(found) / "config.json").resolve() == checkpoint / "config.json"


def test_lora_adapter_reads_as_a_zero_delta_of_the_model(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from kvscope.models.hf_checkpoint import model_config_from_hf
    from kvscope.models.lora import read_adapter

    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32}
    hf |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    hf |= {"intermediate_size": 48}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "tokenizer.json").write_text("{}")
    out = models.lora_adapter(tmp_path / "lora", tmp_path)
    assert (out / "tokenizer.json").read_text() == "{}"  # tests load it from the adapter
    config = model_config_from_hf(hf, {})
    read_adapter("a", str(out), config, device=torch.device("cpu"), max_rank=models.LORA_RANK)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    b = [t for key, t in tensors.items() if "lora_B" in key]
    assert len(b) == 2 * len(models.LORA_TARGETS) and all(not t.any() for t in b)


JUNIT = """<testsuites><testsuite>
<testcase classname="tests.entrypoints.openai.models.test_models" name="test_check_models"/>
<testcase classname="tests.entrypoints.openai.test_x.TestGroup" name="test_b[1]">
  <failure message="AssertionError: assert 'a' == 'b'&#10;more">trace</failure></testcase>
<testcase classname="tests.entrypoints.openai.test_x" name="test_c">
  <skipped message="needs a GPU"/></testcase>
</testsuite></testsuites>"""


def test_read_junit_gives_each_test_its_outcome_and_first_line(tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)
    outcomes = results.read_junit(path)
    assert outcomes == {
        "models/test_models.py::test_check_models": results.Outcome("passed"),
        "test_x.py::TestGroup::test_b[1]": results.Outcome(
            "failed", "AssertionError: assert 'a' == 'b'"
        ),
        "test_x.py::test_c": results.Outcome("skipped", "needs a GPU"),
    }
    run = results.ServerRun("kvscope", "smollm2", 1, 2.0, [], outcomes)
    table = results.table([run, results.ServerRun("vllm", "ckpt", 0, 3.0, [], {})])
    assert "| `test_x.py::TestGroup::test_b[1]` | failed | - | AssertionError" in table
    assert table.endswith("kvscope: failed 1 passed 1 skipped 1, vllm: ")


#: One of vLLM's tests: one question to the server its file starts.
ONE_TEST = "chat_completion/test_chat_completion.py::test_invalid_regex"
ONE_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"


@pytest.mark.slow
def test_one_of_vllms_tests_runs_against_kvscope_serve(tmp_path: Path) -> None:
    from kvscope.bench.core.servers import DEFAULT_VLLM_PYTHON
    from kvscope.bench.vllm_tests import command

    if not Path(DEFAULT_VLLM_PYTHON).exists():
        pytest.skip(f"vLLM is not installed ({DEFAULT_VLLM_PYTHON}; docs/vllm-tests.md)")
    if not (command.CACHE / sdist.SDIST_URL.rsplit("/", 1)[-1]).exists():
        pytest.skip("vLLM's sdist is not in the cache (a first `bench vllm-tests` fetches it)")
    if not (command.CONVERTED / "config.json").exists():
        pytest.skip("SmolLM2 is not converted yet (a first `bench vllm-tests` does it)")
    out = tmp_path / "out.json"
    argv = ["bench", "vllm-tests", "--tests", ONE_TEST, "--kvscope-args", "--worker thread"]
    argv += ["--logs", str(tmp_path), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(kvscope.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "kvscope.cli", *argv], env=env, timeout=120)
    assert done.returncode == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["outcomes"] == {f"{ONE_TEST}[{ONE_MODEL}]": {"outcome": "passed", "message": ""}}
    (launch,) = run["launches"]
    served = f"--served-model-name {ONE_MODEL} --worker thread"
    assert " ".join(launch["argv"]).endswith(served)


def test_hf_home_relinks_a_name_only_when_its_checkpoint_changes(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for checkpoint in (first, second):
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text(checkpoint.name)
    home = models.hf_home(tmp_path / "home", ["org/a"], first)
    config = home / "hub" / "models--org--a" / "snapshots" / models.SNAPSHOT / "config.json"
    stamp = config.lstat().st_mtime_ns
    models.hf_home(home, ["org/a"], first)
    assert config.lstat().st_mtime_ns == stamp
    models.hf_home(home, ["org/a"], second)
    assert config.read_text() == "second"


class CachedHub:
    """An `hf_api()` whose cache holds one repository."""

    def snapshot_download(self, repo_id: str, **_: object) -> str:
        if repo_id != "org/model":
            raise LookupError(repo_id)
        return "/hub/org-model"

    def list_repo_files(self, repo_id: str) -> list[str]:
        return ["config.json"]


def test_adapters_stand_in_only_for_what_the_cache_lacks() -> None:
    from kvscope.bench.vllm_tests.pytest_plugin import LocalAdapters

    api = LocalAdapters("/lora", CachedHub())
    assert api.snapshot_download(repo_id="org/model") == "/hub/org-model"
    assert api.snapshot_download(repo_id="someone/an-adapter") == "/lora"
    assert api.list_repo_files("org/model") == ["config.json"]
