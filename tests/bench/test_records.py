"""The benchmarks' typed records against the files they wrote: every JSON in
docs/benchmarks loads in `bench report`, keeps every key it had, and round-trips; a
record that lost or renamed a field fails here. No benchmark runs (see the smoke tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from kvscope.bench.cancel.records import CancelRun  # noqa: E402
from kvscope.bench.report import load, tables  # noqa: E402
from kvscope.cli import main  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
SAVED = sorted(
    p for p in DOCS.glob("*.json") if json.loads(p.read_text()).get("benchmark") is not None
)


def missing_keys(original: Any, written: Any, where: str = "") -> list[str]:
    """Keys of `original` (nested dicts and lists of them) that `written` lacks."""
    if isinstance(original, dict) and isinstance(written, dict):
        out = [f"{where}.{k}" for k in original if k not in written]
        for k in original.keys() & written.keys():
            out += missing_keys(original[k], written[k], f"{where}.{k}")
        return out
    if isinstance(original, list) and isinstance(written, list):
        return [
            m
            for i, (a, b) in enumerate(zip(original, written, strict=True))
            for m in missing_keys(a, b, f"{where}[{i}]")
        ]
    return []  # fmt: skip


def test_docs_hold_both_kinds() -> None:
    kinds = {json.loads(p.read_text())["benchmark"] for p in SAVED}
    assert kinds == {"cancel", "throughput"}, SAVED


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.name)
def test_saved_json_loads_keeps_every_key_and_round_trips(path: Path) -> None:
    original = json.loads(path.read_text())
    result = load(path)
    written = result.as_dict()
    if "format" not in original and original["benchmark"] == "throughput":
        original.pop("headline")  # format 1: its headline is recomputed (see `report`)
    assert missing_keys(original, written) == []
    assert type(result).from_dict(json.loads(json.dumps(written))) == result
    assert result.format == original.get("format", 1)
    assert "kvscope revision" in tables(result)


def test_a_renamed_or_unknown_field_is_an_error() -> None:
    (path,) = [p for p in SAVED if p.name == "cancel.json"]
    run = json.loads(path.read_text())["runs"][0]
    CancelRun.from_dict(run)  # as saved: fine
    with pytest.raises(ValueError, match="has no field delete_rtt"):
        CancelRun.from_dict({**run, "delete_rtt": run["delete_rtt_ms"]})
    without = {k: v for k, v in run.items() if k != "delete_rtt_ms"}
    with pytest.raises(TypeError, match="delete_rtt_ms"):
        CancelRun.from_dict(without)  # a figure every file has is required


def test_report_command_prints_every_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "report", *map(str, SAVED)]) == 0
    out = capsys.readouterr().out
    assert out.count("kvscope revision") == len(SAVED)
    assert "1. DELETE round trip (client)" in out and "Output tokens/s" in out


def test_peer_launchers_stay_out_of_other_commands() -> None:
    """Only `bench throughput`'s phases import the vLLM and transformers peers."""
    script = (
        "import sys\n"
        "import kvscope.bench.cli, kvscope.bench.report, kvscope.bench.cancel.command\n"
        "import kvscope.bench.throughput.command\n"
        "peers = [m for m in sys.modules if m.endswith(('vllm_peer', 'hf_peer'))]\n"
        "assert not peers, peers\n"
        "assert 'transformers' not in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_a_format_1_cancel_run_knows_its_worker() -> None:
    """Format 1 had no `worker` field: it is read from the `--server-arg`s of the run."""
    cancel_runs = [p for p in SAVED if p.name.startswith("cancel-") and "worker" in p.name]
    workers = {p.name: [r.worker for r in load(p).runs] for p in cancel_runs}
    assert workers == {
        "cancel-2026-11-30-worker-process-128.json": ["process"],
        "cancel-2026-11-30-worker-process.json": ["process"],
        "cancel-2026-11-30-worker-thread.json": ["thread"],
    }


def test_a_pooled_run_says_how_many_streams_ran_at_once() -> None:
    """With `--rounds 2` each run pools the streams of two rounds: the report says how
    many ran at once (the `--requests`) and that rounds were pooled."""
    result = load(DOCS / "cancel-2026-11-30-s6.json")
    assert result.config["rounds"] == 2 and result.config["requests"] == 32
    assert result.runs[0].requests == 64
    text = tables(result)
    assert "32 concurrent streams" in text and "(2 rounds pooled)" in text
    assert "64 concurrent" not in text


def test_a_run_records_the_cpus_vector_extensions() -> None:
    """Two machines of one model name (AMD EPYC, with and without AVX-512) run other
    kernel paths: a run says which it had, and its tables' first line shows it."""
    from kvscope.bench.core.machine import VECTOR_FLAGS, describe

    machine = describe()
    flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    assert machine.vector_extensions == [f for f in VECTOR_FLAGS if f in flags]
    assert machine.summary().startswith(f"kvscope revision {machine.kvscope_revision}; ")
    if machine.vector_extensions:
        assert ", ".join(machine.vector_extensions) in machine.summary()
