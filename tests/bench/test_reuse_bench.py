"""`bench throughput --workload reuse --speculative-config`: the reuse workload's
prompts (distinct token ids, each holding its snippet, rendered with the model's chat
template), the flag reaching kvscope serve (whose counters then count drafts) and vLLM
(measured without it where it refuses it, and saying so), and the record naming the
workload and the config. Tiny models and sizes; shapes, never timings."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from kvscope.bench.core.reuse_workload import (  # noqa: E402
    INSTRUCTIONS,
    reuse_prompts,
    tokenizer_and_template,
)
from kvscope.bench.report import load  # noqa: E402
from kvscope.cli import main  # noqa: E402
from kvscope.models.loaded import chat_text  # noqa: E402
from kvscope.models.loader import BUNDLED_DIR  # noqa: E402

#: Drafts on random weights: a one-token match finds one nearly every step.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
SPEC |= {"prompt_lookup_min": 1}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.mark.parametrize("model", ["tiny-random", "bundled"])
def test_reuse_prompts_are_distinct_and_hold_their_snippets(model: str) -> None:
    tokenizer, template = tokenizer_and_template(model)
    prompts = reuse_prompts(model, 6, 40, seed=1)
    assert len({tuple(p.token_ids) for p in prompts}) == 6
    assert len({p.snippet for p in prompts}) == 6
    assert {p.instruction for p in prompts} == set(INSTRUCTIONS)
    for p in prompts:
        text = tokenizer.decode(p.token_ids, skip_special_tokens=False)
        assert p.snippet in text and p.instruction in text.split(p.snippet)[1]
        assert len(tokenizer.encode(p.snippet, add_special_tokens=False)) >= 40
    # No two share more than the chat's head: what comes before the snippet.
    head = tokenizer.decode(prompts[0].token_ids, skip_special_tokens=False)
    head = head.split(prompts[0].snippet)[0]
    if template is not None:  # the template's own, up to the user's content
        assert (
            head == chat_text(template, tokenizer, [{"role": "user", "content": "|"}]).split("|")[0]
        )
    for a in prompts:
        for b in prompts:
            if a is not b:
                shared = a.token_ids[: _common_prefix(a.token_ids, b.token_ids)]
                assert head.startswith(tokenizer.decode(shared, skip_special_tokens=False))
    # A later call of the same run names its snippets apart from the first call's.
    later = reuse_prompts(model, 2, 40, seed=2, start=6)
    assert not {p.snippet.splitlines()[0] for p in later} & {
        p.snippet.splitlines()[0] for p in prompts
    }


def _argv(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    argv = ["bench", "throughput", "--dtype", "float32", "--concurrency", "1"]
    argv += ["--min-requests", "2", "--max-tokens", "8", "--threads", "1"]
    argv += ["--worker", "thread", "--paired-rounds", "0", "--workload", "reuse"]
    argv += ["--speculative-config", json.dumps(SPEC), "--log-dir", str(tmp_path)]
    return [*argv, "--json", str(out), *extra]


def test_speculative_reuse_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    argv = _argv(tmp_path, out, "--model", "tiny-random", "--peers", "kvscope-serve,transformers")
    assert main(argv) == 0
    r = json.loads(out.read_text())
    config = r["config"]
    assert config["workload"] == "reuse" and config["speculative_config"] == SPEC
    assert config["prompt_tokens"] is None and config["prompt_tokens_range"][0] > 8
    # kvscope serve ran with the config, then without it, each row saying which.
    with_spec, without = r["kvscope_serve"]
    assert (with_spec["speculative"], without["speculative"]) == (True, False)
    argv_with, argv_without = with_spec["settings"]["argv"], without["settings"]["argv"]
    assert json.loads(argv_with[argv_with.index("--speculative-config") + 1]) == SPEC
    assert "--speculative-config" not in argv_without and without["spec_decode"] is None
    drafts = with_spec["spec_decode"]
    assert drafts["vllm:spec_decode_num_drafts"] > 0
    assert drafts["vllm:spec_decode_num_draft_tokens"] >= drafts["vllm:spec_decode_num_drafts"]
    for run in r["kvscope_serve"]:
        assert all(lv["output_tokens"] == lv["requests"] * 8 for lv in run["levels"])
    (engine,) = r["kvscope"]
    assert engine["speculative"] and engine["stats_after"]["spec_decode_num_drafts"] > 0
    level = r["headline"]["by_threads"]["1"]["levels"]["1"]
    assert level["no_speculation_tokens_per_s"] == without["levels"][0]["tokens_per_s"]
    assert level["x_no_speculation"] > 0
    assert "runs the random workload only" in r["missing"]["transformers"]
    printed = capsys.readouterr().out
    assert "workload reuse" in printed and f"speculative config {json.dumps(SPEC)}" in printed
    assert "| kvscope serve, thread worker, no speculation (HTTP) " in printed
    assert load(out).as_dict() == r


def _refusing_vllm(tmp_path: Path) -> Path:
    """A stand-in for vLLM's python: kvscope serve under vLLM's argv, refusing
    `--speculative-config` as a build without speculative decoding would."""
    python = tmp_path / "fake-vllm" / "python"
    python.parent.mkdir()
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -c ]; then echo 0.0-fake; exit 0; fi\n'
        'case "$*" in *--speculative-config*) '
        'echo "ValueError: speculative decoding is not supported here" >&2; exit 1;; esac\n'
        "shift 2  # -m vllm.entrypoints.openai.api_server\n"
        f'exec {sys.executable} -m kvscope.cli serve --worker thread "$@"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


@pytest.mark.skipif(not os.access("/bin/sh", os.X_OK), reason="needs /bin/sh")
def test_vllm_refusing_the_config_is_measured_without_it(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    python = _refusing_vllm(tmp_path)
    argv = _argv(tmp_path, out, "--model", "bundled", "--peer-model", str(BUNDLED_DIR))
    assert main([*argv, "--peers", "vllm", "--vllm-python", str(python)]) == 0
    r = json.loads(out.read_text())
    (vllm,) = r["vllm"]
    assert vllm["speculative"] is False and vllm["spec_decode"] is None
    assert "--speculative-config" not in vllm["settings"]["argv"]
    why = r["missing"]["vllm threads=1 --speculative-config"]
    assert "measured without it" in why and "not supported here" in why
    head = r["headline"]["by_threads"]["1"]
    assert head["vllm_run"] == "vLLM CPU, no speculation"


def test_vllm_is_given_the_config_without_the_keys_it_refuses() -> None:
    from kvscope.bench.throughput.vllm_peer import for_vllm

    given = '{"method": "ngram", "num_speculative_tokens": 5, "disable_by_batch_size": 8}'
    assert json.loads(for_vllm(given)) == {"method": "ngram", "num_speculative_tokens": 5}
