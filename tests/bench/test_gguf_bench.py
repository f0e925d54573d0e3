"""`kvscope bench` on a GGUF file: `vocab_size_of` and `bench convert` read a tiny
Q4_1 file (written the way llama.cpp's converter writes one, tests/models/gguf_files.py);
`bench throughput` runs kvscope serve on it in both dtypes (the file's Q4_1 and
dequantized bfloat16, each row named), transformers on its conversion (`--peer-model`),
and llama.cpp's `llama-server` where `$KVSCOPE_LLAMA_SERVER` names one (skipped with
the reason where not; MISSING, with the reason, in the record). Shapes, never timings."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvscope.bench.core.workload import vocab_size_of  # noqa: E402
from kvscope.bench.report import load  # noqa: E402
from kvscope.bench.throughput.llamacpp_peer import (  # noqa: E402
    LLAMA_SERVER_ENV,
    llama_server_missing,
)
from kvscope.cli import main  # noqa: E402


class TinyGGUF:
    def __init__(self, root: Path) -> None:
        from tests.models.conftest import build_checkpoint
        from tests.models.gguf_files import Q, convert_checkpoint

        self.checkpoint = build_checkpoint("llama", root / "hf")
        # Every matrix Q4_1 (as SmolLM2's file), the norms F32.
        self.path, self.weights = convert_checkpoint(
            self.checkpoint,
            root / "tiny.Q4_1.gguf",
            arch="llama",
            qtype_of=lambda name: Q.F32 if name.endswith("norm.weight") else Q.Q4_1,
        )
        self.converted = root / "converted"

    @property
    def tokens(self) -> int:
        return len(json.loads((self.checkpoint / "tokenizer.json").read_text())["model"]["vocab"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyGGUF:
    return TinyGGUF(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def converted(tiny: TinyGGUF) -> Path:
    assert main(["bench", "convert", str(tiny.path), str(tiny.converted)]) == 0
    return tiny.converted


def test_vocab_size_of_a_gguf_file(tiny: TinyGGUF, tmp_path: Path) -> None:
    assert vocab_size_of(str(tiny.path)) == tiny.tokens == vocab_size_of(str(tiny.checkpoint))
    holder = tmp_path / "holder"  # a directory holding the one file, as the loader takes it
    holder.mkdir()
    shutil.copy(tiny.path, holder / tiny.path.name)
    assert vocab_size_of(str(holder)) == tiny.tokens


def test_convert_writes_the_files_weights(tiny: TinyGGUF, converted: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    saved = load_file(converted / "model.safetensors")
    assert set(saved) == set(tiny.weights)
    for name, expected in tiny.weights.items():  # as the file holds them, in HF's layout
        assert saved[name].dtype == torch.bfloat16, name
        want = torch.from_numpy(expected).to(torch.bfloat16)
        torch.testing.assert_close(saved[name], want, rtol=0, atol=0, msg=name)
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config and config["vocab_size"] == tiny.tokens
    text = "The quick brown fox jumps over the lazy dog."
    original = AutoTokenizer.from_pretrained(tiny.checkpoint)
    assert AutoTokenizer.from_pretrained(converted).encode(text) == original.encode(text)


def test_convert_refuses_what_is_no_gguf_file(
    tiny: TinyGGUF, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny.checkpoint / "config.json"
    assert main(["bench", "convert", str(config), str(tmp_path / "out")]) == 2
    assert f"{config} is not a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_llama_server_missing_says_why(tmp_path: Path) -> None:
    assert "--llama-server PATH" in (llama_server_missing(None) or "")
    absent = tmp_path / "llama-server"
    assert "is not an executable llama-server" in (llama_server_missing(str(absent)) or "")
    absent.write_text("")  # a file that cannot be run
    assert "is not an executable llama-server" in (llama_server_missing(str(absent)) or "")


def _throughput(model: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--model", str(model), "--concurrency", "1,2"]
    argv += ["--min-requests", "2", "--prompt-tokens", "16", "--max-tokens", "4"]
    argv += ["--threads", "1", "--worker", "thread", "--paired-rounds", "0"]
    argv += ["--log-dir", str(tmp_path), "--json", str(out), *extra]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert load(out).as_dict() == r  # `bench report` reads every field back
    return r


def _all_tokens(run: dict[str, Any]) -> bool:
    return all(lv["output_tokens"] == lv["requests"] * 4 for lv in run["levels"])


def test_throughput_on_a_gguf_file(
    tiny: TinyGGUF,
    converted: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kvscope serve runs the file as it is and dequantized, each row saying which;
    transformers runs the conversion; llama.cpp, given no binary, is MISSING."""
    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    r = _throughput(
        tiny.path,
        tmp_path,
        "--peer-model",
        str(converted),
        "--peers",
        "kvscope-serve,transformers,llama.cpp",
        "--hf-requests",
        "1",
    )
    assert r["config"]["model_weights"] == "Q4_1" and r["config"]["peer_model"] == str(converted)
    served = r["kvscope_serve"]
    assert [(s["dtype"], s["weights"]) for s in served] == [
        ("auto", "Q4_1"),
        ("bfloat16", "bfloat16"),
    ]
    for s in served:
        argv = s["settings"]["argv"]
        assert argv[argv.index("--dtype") + 1] == s["dtype"] and str(tiny.path) in argv
        assert _all_tokens(s)
    (hf,) = r["transformers"]
    assert hf["one_at_a_time"]["output_tokens"] == 4
    assert "--llama-server PATH" in r["missing"]["llama.cpp"] and r["llama_cpp"] == []
    assert r["headline"]["by_threads"]["1"]["llama_cpp"] == {}
    printed = capsys.readouterr().out
    assert "| kvscope serve, thread worker, Q4_1 (HTTP) " in printed
    assert "| kvscope serve, thread worker, bfloat16 (HTTP) " in printed
    assert f"Model: {tiny.path} (Q4_1); vLLM and transformers: {converted}" in printed
    assert "PEER MISSING: llama.cpp" in printed


def _llama_server() -> str:
    binary = os.environ.get(LLAMA_SERVER_ENV)
    if why := llama_server_missing(binary):
        pytest.skip(f"no llama.cpp to run: {why}")
    assert binary is not None
    return binary


def test_llama_cpp_peer_smoke(
    tiny: TinyGGUF, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama-server serves the file with a slot per stream, measured as kvscope serve
    is, and the headline compares kvscope's Q4_1 row with it."""
    binary = _llama_server()
    r = _throughput(
        tiny.path, tmp_path, "--peers", "kvscope-serve,llama.cpp", "--serve-dtype",
        "bfloat16,auto", "--llama-server", binary,
    )  # fmt: skip
    assert "llama.cpp" not in r["missing"] and r["machine"]["llama_cpp"]
    (run,) = r["llama_cpp"]
    assert run["weights"] == "Q4_1" and _all_tokens(run)
    for lv in run["levels"]:
        assert lv["ttft_ms"]["p99"] is not None and lv["itl_ms"]["p50"] is not None
    cold = run["cold_start"]
    assert 0 < cold["ready_s"] <= cold["first_token_s"]
    argv = run["settings"]["argv"]
    assert argv[0] == binary and argv[argv.index("-m") + 1] == str(tiny.path)
    assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("-t") + 1] == "1"
    assert int(argv[argv.index("-c") + 1]) >= 2 * (16 + 4)
    assert run["processes_left"] == 0
    head = r["headline"]["by_threads"]["1"]
    # Compared with kvscope's row of the file's own weights, though it ran second.
    assert head["llama_cpp_compared_with"] == "kvscope serve, thread worker, Q4_1"
    auto = next(s for s in r["kvscope_serve"] if s["dtype"] == "auto")
    for c in ("1", "2"):
        level = head["llama_cpp"][c]
        ours = next(lv for lv in auto["levels"] if lv["concurrency"] == int(c))
        assert level["kvscope_serve_tokens_per_s"] == ours["tokens_per_s"]
        assert level["x_peer"] == round(ours["tokens_per_s"] / level["peer_tokens_per_s"], 2)
    printed = capsys.readouterr().out
    assert "kvscope served against llama.cpp's llama-server" in printed
    assert "| llama.cpp " in printed


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--peers", "kvscope-serve,llamacpp"], "--peers: unknown llamacpp"),
        (["--serve-dtype", "auto,q4"], "--serve-dtype: unknown q4"),
        (["--peer-model", "{tmp}"], "no config.json there"),
    ],
)
def test_throughput_refuses_bad_arguments_by_name(
    extra: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "throughput", *[a.format(tmp=tmp_path) for a in extra]]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
