"""Smoke tests of `kvscope bench`: each benchmark runs end to end with tiny settings,
writes a JSON with every figure, and `bench report` reads it back into the same record.
They check shape, never timings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvscope.bench.report import load
from kvscope.cli import main
from kvscope.web.serve import SERVED_WORKER

TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=400,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from kvscope.bench.core.reference_model import build_reference_model

    return build_reference_model(
        tmp_path_factory.mktemp("ckpt") / "tiny-llama", shape=TINY_SHAPE, text_limit=20
    )


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_throughput_smoke(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, plot = tmp_path / "t.json", tmp_path / "t.png"
    argv = [
        "bench",
        "throughput",
        "--model",
        str(tiny_checkpoint),
        "--dtype",
        "float32",
        "--concurrency",
        "1,2",
        "--min-requests",
        "2",
        "--prompt-tokens",
        "16",
        "--max-tokens",
        "4",
        "--threads",
        "1",
        "--hf-requests",
        "1",
        "--peers",
        "transformers,vllm,llama.cpp,kvscope-serve",
        "--worker",
        "process,thread",
        "--paired-rounds",
        "2",
        "--vllm-python",
        str(tmp_path / "no-vllm" / "python"),
        "--llama-server",
        str(tmp_path / "no-llama.cpp" / "llama-server"),
        "--log-dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    if _has_matplotlib():
        argv += ["--plot", str(plot)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["machine"]["cores"] and r["config"]["concurrency"] == [1, 2]
    (run,) = r["kvscope"]
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 2]
    for lv in run["levels"]:
        assert lv["output_tokens"] == lv["requests"] * 4 and lv["tokens_per_s"] > 0
        assert lv["ttft_ms"]["p99"] is not None and lv["itl_ms"]["p99"] is not None
    assert set(run["step_overhead"]) == {"1", "2"}
    for figures in run["step_overhead"].values():
        assert 0 <= figures["outside_forward_share"] <= 1
    assert run["stats_after"]["kv_blocks_in_use"] == 0
    # Each worker is served and measured on its own.
    assert [served["worker"] for served in r["kvscope_serve"]] == ["process", "thread"]
    for served in r["kvscope_serve"]:
        assert all(lv["output_tokens"] == lv["requests"] * 4 for lv in served["levels"])
        for lv in served["levels"]:  # the light client's own CPU, reported per level
            assert lv["client_cpu_s"] >= 0 and 0 <= lv["client_cpu_share"] <= 1
        cold = served["cold_start"]
        assert 0 < cold["ready_s"] <= cold["first_token_s"]
        # the levels waited for the worker process, or the thread worker's warm-up
        assert cold["fully_up_s"] >= cold["ready_s"]
        argv_served = served["settings"]["argv"]
        assert served["load_average"]["before"] is not None and "--model-threads" in argv_served
        assert argv_served[argv_served.index("--worker") + 1] == served["worker"]
        assert served["processes_left"] == 0  # the model worker was stopped and reaped
    # The serving path's cost: served and in-process taking turns, with the first worker.
    (paired,) = r["paired"]
    assert paired["worker"] == "process" and paired["rounds"] == 2
    assert [lv["concurrency"] for lv in paired["levels"]] == [1, 2]
    for lv in paired["levels"]:
        served, engine = lv["served_tokens_per_s"], lv["engine_tokens_per_s"]
        assert len(served) == len(engine) == 2 and min(served + engine) > 0
        assert lv["ratios"] == [round(s / e, 3) for s, e in zip(served, engine, strict=True)]
        assert min(lv["ratios"]) <= lv["ratio_median"] <= max(lv["ratios"])
    printed = capsys.readouterr().out
    assert "The serving path's cost" in printed
    assert "| kvscope serve, thread worker (HTTP) " in printed
    assert "| kvscope serve, process worker (HTTP) " in printed
    first_served = r["kvscope_serve"][0]
    (hf,) = r["transformers"]
    assert hf["one_at_a_time"]["output_tokens"] == 4 and hf["static_batch"][0]["batch"] == 2
    assert "vllm" in r["missing"] and "not installed" in r["missing"]["vllm"]
    assert "is not an executable llama-server" in r["missing"]["llama.cpp"]
    assert r["llama_cpp"] == [] and r["machine"]["llama_cpp"] is None
    head = r["headline"]["by_threads"]["1"]
    for c in ("1", "2"):  # served is compared with served; vLLM is missing here
        level = head["levels"][c]
        assert level["kvscope_serve_tokens_per_s"] > 0 and level["engine_tokens_per_s"] > 0
        # The headline takes the first worker given.
        first_level = next(lv for lv in first_served["levels"] if lv["concurrency"] == int(c))
        assert level["kvscope_serve_tokens_per_s"] == first_level["tokens_per_s"]
        assert level["vllm_tokens_per_s"] is None and level["x_vllm"] is None
    assert "x_transformers_one_at_a_time" in head
    assert r["format"] == 2 and load(out).as_dict() == r
    if _has_matplotlib():
        assert plot.is_file()


def test_throughput_sampled_smoke(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--temperature` and `--top-p` reach every system's requests and the record; the
    transformers peer, greedy only, says why it did not run."""
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--model", str(tiny_checkpoint), "--dtype", "float32"]
    argv += ["--concurrency", "1", "--min-requests", "2", "--prompt-tokens", "16"]
    argv += ["--max-tokens", "4", "--threads", "1", "--peers", "kvscope-serve,transformers"]
    argv += ["--worker", "thread", "--paired-rounds", "0", "--temperature", "1"]
    argv += ["--top-p", "0.9", "--log-dir", str(tmp_path), "--json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["config"]["temperature"] == 1 and r["config"]["top_p"] == 0.9
    (served,) = r["kvscope_serve"]
    assert all(lv["output_tokens"] == lv["requests"] * 4 for lv in served["levels"])
    assert "greedy only" in r["missing"]["transformers"]
    assert "Requests: sampled at temperature 1, top_p 0.9, ignore_eos" in capsys.readouterr().out


def test_cancel_smoke(tmp_path: Path) -> None:
    out, plot = tmp_path / "c.json", tmp_path / "c.png"
    argv = [
        "bench",
        "cancel",
        "--model",
        "tiny-random",
        "--dtype",
        "float32",
        "--requests",
        "8",
        "--prompt-tokens",
        "32",
        "--max-tokens",
        "24",
        "--cancel-after",
        "2,4",
        "--jitter-ms",
        "1",
        "--stats-interval",
        "0.02",
        "--rounds",
        str(rounds := 2),
        "--log-dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    if _has_matplotlib():
        argv += ["--plot", str(plot)]
    assert main(argv) == 0  # nonzero means something leaked
    r = json.loads(out.read_text())
    (f,) = r["runs"]
    assert f["errors"] == []
    # The server (on the model worker process) stopped and reaped every child it started.
    assert f["leaked"]["processes"] == 0
    # Each round's run with cancels: 3 DELETEs and 1 closed stream; the same 4 survivors.
    deletes, disconnects = 3 * rounds, 1 * rounds
    assert f["deletes"] == deletes and f["disconnects"] == disconnects
    assert f["survivor_count"] == 4 and f["delete_status"] == {"200": deletes}
    assert f["delete_rtt_ms"]["count"] == deletes
    assert f["cancel_to_release_ms_report"]["count"] == deletes
    assert f["cancel_to_release_ms_audit"]["count"] == deletes + disconnects
    assert f["disconnect_to_cancel_ms"]["count"] == disconnects
    assert f["disconnect_cancel_reasons"] == {"disconnect": disconnects}
    for key in ("ttft_ms", "itl_ms"):
        for side in ("with_cancels", "without"):
            assert f["survivors"][key][side]["p99"] is not None
        assert f["survivors"][key]["ratio_p99"] is not None
    # Each round's run of each kind has its own inter-token p99, and the baseline's two
    # rounds give the spread the run cannot resolve.
    by_round = f["survivors"]["itl_p99_ms_by_round"]
    assert sorted(by_round) == ["baseline", "with_cancels"]
    assert all(len(p99s) == rounds for p99s in by_round.values())
    assert all(p99 is not None for p99s in by_round.values() for p99 in p99s)
    base = by_round["baseline"]
    assert f["survivors"]["itl_p99_baseline_spread"] == pytest.approx(
        max(base) / min(base), abs=2e-3
    )
    assert f["loop_lag"]["with_cancels"]["samples"] > 0 and f["worker"] == SERVED_WORKER
    # Hops 2 and 4 of each DELETE (audit stamps against the client's wall clock), and
    # hop 4 split where the CancelReport was made (the server's clock, then the rest).
    hops = ("delete_sent_to_cancelled_ms", "released_to_reply_ms")
    for hop in (*hops, "released_to_report_ms", "report_to_reply_ms"):
        assert f[hop]["count"] == deletes and f[hop]["p50"] is not None
    assert f["client"]["library"] == "aiohttp"
    assert set(f["client"]["cpu_s"]) == {"with_cancels", "baseline"}
    assert f["checkpoint_gap"]["baseline"]["samples"] > 0  # every step counts its gaps
    # The machine's wake-up floor, sampled beside the run with cancels.
    assert f["wake_floor_ms"]["count"] > 0 and f["wake_floor_ms"]["p99"] is not None
    # The core the server's event loop ran on, sampled beside /stats: cores this
    # machine has, one sample at least.
    assert f["loop_cores"] and sum(f["loop_cores"].values()) > 0
    assert {int(core) for core in f["loop_cores"]} <= set(range(os.cpu_count() or 1))
    assert (
        f["leak_free"]
        and f["leaked"]["kv_blocks_in_use"] == 0
        and f["leaked"]["live_requests"] == 0
    )
    assert f["kv_timeline"]["with_cancels"] and len(f["cancel_times"]) == deletes + disconnects
    assert set(f["targets"]) >= {
        "delete_rtt_p50_ms<=2",
        "delete_rtt_p99_ms<=5",
        "cancel_to_release_p50_ms<=0.5",
        "cancel_to_release_p99_ms<=10",
        "event_loop_lag_p99_ms<=2",
        "survivor_itl_p99_ratio<=1.05",
        "leaked==0",
    }
    assert r["format"] == 2 and r["machine"]["kvscope_revision"]
    assert load(out).as_dict() == r  # `bench report` reads it back, every field
    if _has_matplotlib():
        assert plot.is_file()
