"""`kvscope bench throughput`: output tokens/s against `transformers` and vLLM.

For each torch thread count (default 1 and 2), on the reference model and the same
prompt token ids: kvscope's engine in-process at each concurrency (default 1, 8, 32);
optionally `kvscope serve` driven over HTTP like vLLM; `transformers` `generate` one
request at a time and as a static batch; vLLM's CPU build where installed (each phase
alone on the machine). Also the step loop's overhead at batch 1 and at the largest
concurrency. Prints tables, writes `--json` and `--plot`.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from . import hf_peer, machine, servers
from .engine_run import run_engine
from .http_client import run_http_level, served_model
from .report import throughput_tables
from .workload import Workload, make_prompts, vocab_size_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint dir or tiny-random (default: the reference Llama, built on first use)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument(
        "--min-requests",
        type=int,
        default=4,
        help="requests per level at least (a level sends max(this, concurrency))",
    )
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--threads",
        default="1,2",
        help="torch threads for the model (comma-separated, each measured)",
    )
    p.add_argument(
        "--hf-requests", type=int, default=4, help="requests for transformers one at a time"
    )
    p.add_argument(
        "--peers",
        default="transformers,vllm",
        help="peers to run: transformers,vllm,kvscope-serve (or none)",
    )
    p.add_argument(
        "--vllm-python",
        default=servers.DEFAULT_VLLM_PYTHON,
        help="python of the venv vLLM's CPU build is installed in",
    )
    p.add_argument(
        "--level-timeout", type=float, default=600, help="seconds before a level is abandoned"
    )
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kvscope-bench"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_levels(args: argparse.Namespace, vocab: int) -> list[tuple[int, Workload]]:
    levels = []
    for c in _ints(args.concurrency):
        count = max(c, args.min_requests)
        prompts = make_prompts(count, args.prompt_tokens, vocab, seed=1000 + c)
        levels.append((c, Workload(prompts, args.max_tokens)))
    return levels


async def _http_peer(
    server: servers.Server,
    model: str | None,
    levels: list[tuple[int, Workload]],
    timeout: float,
    label: str,
    threads: int,
) -> list[dict[str, Any]]:
    out = []
    async with server:
        model = model or await served_model(server.base_url)
        warm = Workload([levels[0][1].prompts[0][::-1]], 4)  # a prompt none of the levels uses
        await run_http_level(server.base_url, model, warm, 1, timeout)
        for c, workload in levels:
            level = await run_http_level(server.base_url, model, workload, c, timeout)
            out.append(level)
            print(
                f"  {label} threads={threads} concurrency={c}: {level['tokens_per_s']:.0f} tok/s, "
                f"ITL p50 {level['itl_ms']['p50']} ms",
                flush=True,
            )
    return out


def run(args: argparse.Namespace) -> int:
    from .reference_model import ensure_reference_model

    model = args.model or str(ensure_reference_model())
    vocab = vocab_size_of(model)
    levels = build_levels(args, vocab)
    peers = {p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"}
    threads_list = _ints(args.threads)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "machine": machine.describe(),
        "config": {
            "model": model,
            "dtype": args.dtype,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "concurrency": _ints(args.concurrency),
            "requests_per_level": {str(c): w.num_requests for c, w in levels},
            "threads": threads_list,
            "hf_requests": args.hf_requests,
            "temperature": 0,
            "ignore_eos": True,
        },
        "kvscope": [],
        "missing": {},
    }
    t_start = time.perf_counter()
    for threads in threads_list:
        print(f"kvscope engine, {threads} thread(s) ...", flush=True)
        result["kvscope"].append(
            anyio.run(
                partial(
                    run_engine, model, threads, levels, dtype=args.dtype, timeout=args.level_timeout
                )
            )
        )

    if "kvscope-serve" in peers:
        result["kvscope_serve"] = []
        for threads in threads_list:
            server = servers.kvscope_server(
                model,
                threads=threads,
                dtype=args.dtype,
                log_path=args.log_dir / f"kvscope-serve-{threads}.log",
                extra=["--max-num-seqs", str(max(_ints(args.concurrency)))],
            )
            print(f"kvscope serve (HTTP), {threads} thread(s) ...", flush=True)
            levels_out = anyio.run(
                _http_peer, server, None, levels, args.level_timeout, "kvscope serve", threads
            )
            result["kvscope_serve"].append({"threads": threads, "levels": levels_out})

    if "transformers" in peers:
        why = hf_peer.available() or (
            None if Path(model).is_dir() else "transformers needs a checkpoint dir, not " + model
        )
        if why:
            result["missing"]["transformers"] = why
            print(f"transformers peer MISSING: {why}", flush=True)
        else:
            result["transformers"] = []
            hf_prompts = make_prompts(args.hf_requests, args.prompt_tokens, vocab, seed=3)
            batches = [(c, w) for c, w in levels if c > 1]
            for threads in threads_list:
                print(f"transformers, {threads} thread(s) ...", flush=True)
                result["transformers"].append(
                    hf_peer.run_hf(
                        model,
                        threads,
                        Workload(hf_prompts, args.max_tokens),
                        batches,
                        dtype=args.dtype,
                    )
                )

    if "vllm" in peers:
        why = (
            servers.vllm_missing(args.vllm_python)
            if Path(model).is_dir()
            else "vLLM needs a checkpoint dir"
        )
        if why:
            result["missing"]["vllm"] = why
            print(f"vLLM peer MISSING: {why}", flush=True)
        else:
            result["vllm"] = []
            result["machine"]["vllm"] = servers.vllm_version(args.vllm_python)
            for threads in threads_list:
                server = servers.vllm_server(
                    args.vllm_python,
                    model,
                    threads=threads,
                    log_path=args.log_dir / f"vllm-{threads}.log",
                )
                print(
                    f"vLLM CPU, {threads} thread(s) (starting takes about a minute) ...", flush=True
                )
                try:
                    levels_out = anyio.run(
                        _http_peer, server, "reference", levels, args.level_timeout, "vLLM", threads
                    )
                except (RuntimeError, TimeoutError) as exc:
                    result["missing"][f"vllm threads={threads}"] = f"{exc}; log: {server.log_path}"
                    print(f"vLLM failed: {exc}\n{server.log_tail()}", flush=True)
                    continue
                result["vllm"].append({"threads": threads, "levels": levels_out})

    result["machine"]["load_average_at_end"] = machine.load_average()
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    result["headline"] = headline(result)
    print()
    print(throughput_tables(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    if args.plot:
        from .plots import plot_throughput

        plot_throughput(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _at(levels: list[dict[str, Any]], c: int) -> float | None:
    return next((lv["tokens_per_s"] for lv in levels if lv["concurrency"] == c), None)


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The targets, per thread count: kvscope at the top concurrency vs the peers."""
    top = max(result["config"]["concurrency"])
    out: dict[str, Any] = {"concurrency": top, "by_threads": {}}
    for run in result["kvscope"]:
        t = run["threads"]
        row: dict[str, Any] = {"kvscope_tokens_per_s": _at(run["levels"], top)}
        hf = next((h for h in result.get("transformers", []) if h["threads"] == t), None)
        if hf:
            row["transformers_one_at_a_time_tokens_per_s"] = hf["one_at_a_time"]["tokens_per_s"]
            row["x_transformers_one_at_a_time"] = round(
                row["kvscope_tokens_per_s"] / hf["one_at_a_time"]["tokens_per_s"], 2
            )
            row["target_3x_transformers_met"] = row["x_transformers_one_at_a_time"] >= 3
        vl = next((v for v in result.get("vllm", []) if v["threads"] == t), None)
        if vl:
            row["vllm_tokens_per_s"] = _at(vl["levels"], top)
            if row["vllm_tokens_per_s"]:
                row["x_vllm"] = round(row["kvscope_tokens_per_s"] / row["vllm_tokens_per_s"], 2)
                row["target_vllm_met"] = row["x_vllm"] >= 1
        out["by_threads"][str(t)] = row
    return out
