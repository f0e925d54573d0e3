"""`kvscope bench throughput`: output tokens/s, served against served.

For each torch thread count (default 1 and 2), on the reference model and the same
prompt token ids, each phase alone on the machine: `kvscope serve` and vLLM's CPU build
(where installed), both driven over HTTP by the same light client on the same route
(streaming `/v1/completions`); kvscope's engine in-process, as its own row (never the
target); `transformers` `generate` one request at a time and as a static batch. The
headline compares kvscope served with vLLM served at every concurrency (tokens/s and
TTFT p50). Also: the step loop's overhead, the client's CPU seconds per level, the time
from spawning `kvscope serve` to its first token, and the load average around each
phase. Prints tables, writes `--json` and `--plot`.
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
        default="kvscope-serve,vllm,transformers",
        help="peers to run: kvscope-serve,vllm,transformers (or none)",
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
) -> dict[str, Any]:
    """Start `server`, time its cold start to a first token, then run every level."""
    out = []
    async with server:
        model = model or await served_model(server.base_url)
        warm = Workload([levels[0][1].prompts[0][::-1]], 4)  # a prompt none of the levels uses
        first = await run_http_level(server.base_url, model, warm, 1, timeout)
        assert server.spawned_at is not None and server.ready_at is not None
        cold_start = {
            "ready_s": round(server.ready_at - server.spawned_at, 2),
            # first request sent once ready; its TTFT added
            "first_token_s": round(
                server.ready_at - server.spawned_at + first["ttft_ms"]["p50"] / 1e3, 2
            ),
        }
        print(f"  {label} threads={threads} cold start: {cold_start}", flush=True)
        for c, workload in levels:
            level = await run_http_level(server.base_url, model, workload, c, timeout)
            out.append(level)
            print(
                f"  {label} threads={threads} concurrency={c}: {level['tokens_per_s']:.0f} tok/s, "
                f"ITL p50 {level['itl_ms']['p50']} ms, client CPU {level['client_cpu_s']} s",
                flush=True,
            )
    return {"cold_start": cold_start, "settings": server.settings, "levels": out}


def _phase(run_phase, *args: Any) -> dict[str, Any]:
    """Run one HTTP phase, with the load average before and after it."""
    before = machine.load_average()
    out = anyio.run(run_phase, *args)
    return {**out, "load_average": {"before": before, "after": machine.load_average()}}


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
            phase = _phase(
                _http_peer, server, None, levels, args.level_timeout, "kvscope serve", threads
            )
            result["kvscope_serve"].append({"threads": threads, **phase})

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
                    phase = _phase(
                        _http_peer, server, "reference", levels, args.level_timeout, "vLLM", threads
                    )
                except (RuntimeError, TimeoutError) as exc:
                    result["missing"][f"vllm threads={threads}"] = f"{exc}; log: {server.log_path}"
                    print(f"vLLM failed: {exc}\n{server.log_tail()}", flush=True)
                    continue
                result["vllm"].append({"threads": threads, **phase})

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


def _level(levels: list[dict[str, Any]], c: int) -> dict[str, Any] | None:
    return next((lv for lv in levels if lv["concurrency"] == c), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The targets, per thread count and concurrency: kvscope served against vLLM
    served (tokens/s >= 1.0x, TTFT p50 no worse); the engine's in-process figure beside
    them, and kvscope against `transformers` one at a time at the top concurrency."""
    top = max(result["config"]["concurrency"])
    out: dict[str, Any] = {"concurrency": top, "by_threads": {}}
    served = {run["threads"]: run["levels"] for run in result.get("kvscope_serve", [])}
    vllm = {run["threads"]: run["levels"] for run in result.get("vllm", [])}
    for run in result["kvscope"]:
        t = run["threads"]
        row: dict[str, Any] = {"levels": {}}
        for c in result["config"]["concurrency"]:
            ours = _level(served.get(t, []), c)
            peer = _level(vllm.get(t, []), c)
            engine = _level(run["levels"], c)
            figures: dict[str, Any] = {
                "engine_tokens_per_s": engine and engine["tokens_per_s"],
                "kvscope_serve_tokens_per_s": ours and ours["tokens_per_s"],
                "vllm_tokens_per_s": peer and peer["tokens_per_s"],
                "kvscope_serve_ttft_p50_ms": ours and ours["ttft_ms"]["p50"],
                "vllm_ttft_p50_ms": peer and peer["ttft_ms"]["p50"],
            }
            figures["x_vllm"] = _ratio(
                figures["kvscope_serve_tokens_per_s"], figures["vllm_tokens_per_s"]
            )
            if figures["x_vllm"] is not None:
                figures["target_vllm_met"] = figures["x_vllm"] >= 1
                figures["ttft_no_worse"] = (
                    figures["kvscope_serve_ttft_p50_ms"] <= figures["vllm_ttft_p50_ms"]
                )
            row["levels"][str(c)] = figures
        hf = next((h for h in result.get("transformers", []) if h["threads"] == t), None)
        ours_top = _level(served.get(t, []), top) or _level(run["levels"], top)
        if hf and ours_top:
            one = hf["one_at_a_time"]["tokens_per_s"]
            row["transformers_one_at_a_time_tokens_per_s"] = one
            row["x_transformers_one_at_a_time"] = _ratio(ours_top["tokens_per_s"], one)
            row["target_3x_transformers_met"] = (row["x_transformers_one_at_a_time"] or 0) >= 3
        out["by_threads"][str(t)] = row
    return out
