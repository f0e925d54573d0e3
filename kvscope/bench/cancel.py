"""`kvscope bench cancel`: the seed's cancellation scenario, scaled to this machine.

Starts the real `kvscope serve` on 127.0.0.1 (with an audit log), opens many concurrent
streaming requests with long prompts, and cancels a share of them part-way through:
most by `DELETE /requests/{id}`, some by closing the stream. Then it repeats the same
workload (fresh prompts of the same shape, so the prefix cache cannot help) with no
cancels as the baseline. Figures come from the client's clock, the CancelReports, the
audit log and the server's `/metrics` and `/stats` (see `cancel_figures`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from . import machine, prometheus, servers
from .cancel_client import Plan, poll_stats, run_stream
from .cancel_figures import figures, read_audit
from .report_cancel import cancel_tables
from .workload import Deadline, make_prompts, vocab_size_of

LAG = "kvscope_event_loop_lag_seconds"
GAP = "kvscope_checkpoint_gap_seconds"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="checkpoint dir or tiny-random (default: the reference Llama)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--threads",
        default="1",
        help="model threads of the server (comma-separated, each measured)",
    )
    p.add_argument("--requests", type=int, default=32, help="concurrent streaming requests")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--cancel-fraction", type=float, default=0.5, help="share of the requests cancelled"
    )
    p.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.25,
        help="share of the cancels done by closing the stream instead of DELETE",
    )
    p.add_argument(
        "--cancel-after", default="8,64", help="cancel after a random number of tokens in MIN,MAX"
    )
    p.add_argument(
        "--jitter-ms",
        type=float,
        default=40.0,
        help="random wait after that token before cancelling, so cancels land anywhere in a step",
    )
    p.add_argument(
        "--stats-interval", type=float, default=0.05, help="seconds between GET /stats samples"
    )
    p.add_argument("--run-timeout", type=float, default=600)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="pairs of runs (with cancels, baseline), alternating which goes first; samples are pooled",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra argument for kvscope serve (repeatable)",
    )
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kvscope-bench"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)


def make_plans(args: argparse.Namespace, vocab: int, prompt_seed: int, cancels: bool) -> list[Plan]:
    prompts = make_prompts(args.requests, args.prompt_tokens, vocab, seed=prompt_seed)
    rng = random.Random(args.seed)  # the same choices in both runs
    n_cancel = round(args.requests * args.cancel_fraction)
    chosen = sorted(rng.sample(range(args.requests), n_cancel))
    n_disconnect = round(n_cancel * args.disconnect_fraction)
    disconnect = set(rng.sample(chosen, n_disconnect))
    low, high = (int(x) for x in args.cancel_after.split(","))
    plans = []
    for i, prompt in enumerate(prompts):
        after, jitter = rng.randint(low, high), rng.uniform(0, args.jitter_ms / 1e3)
        action = "keep" if i not in chosen else "disconnect" if i in disconnect else "delete"
        plans.append(Plan(i, prompt, action if cancels else "keep", after, jitter))
    return plans


async def one_run(base_url: str, plans: list[Plan], args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(
        max_connections=2 * len(plans) + 8, max_keepalive_connections=2 * len(plans) + 8
    )
    async with httpx.AsyncClient(
        base_url=base_url, timeout=args.run_timeout, limits=limits
    ) as client:
        metrics_before = (await client.get("/metrics")).text
        origin = time.perf_counter()
        records: list[dict[str, Any]] = []
        timeline: list[dict[str, Any]] = []
        stop = anyio.Event()

        async def one(plan: Plan) -> None:
            records.append(await run_stream(client, plan, args.max_tokens, origin))

        with anyio.fail_after(args.run_timeout):
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    poll_stats,
                    client,
                    args.stats_interval,
                    origin,
                    stop,
                    timeline,
                    args.run_timeout,
                )
                async with anyio.create_task_group() as streams:
                    for plan in plans:
                        streams.start_soon(one, plan)
                wall = time.perf_counter() - origin
                stop.set()
        metrics_after = (await client.get("/metrics")).text
    lag, gap = (
        prometheus.window(
            prometheus.histogram(metrics_before, name), prometheus.histogram(metrics_after, name)
        )
        for name in (LAG, GAP)
    )
    return {
        "wall_s": round(wall, 3),
        "records": sorted(records, key=lambda r: r["index"]),
        "timeline": timeline,
        "loop_lag_buckets": {str(k): v for k, v in lag.items()},
        "checkpoint_gap_buckets": {str(k): v for k, v in gap.items()},
    }


async def settle(base_url: str, timeout: float = 30) -> dict[str, Any]:
    """`GET /stats` once no request is live (or after `timeout` s), plus `/health`."""
    deadline = Deadline(timeout)
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        while True:
            stats = (await client.get("/stats")).json()
            if stats.get("live_requests", 0) == 0 or deadline.passed:
                break
            await anyio.sleep(0.1)
        health = await client.get("/health")
    try:
        health_body = health.json()
    except ValueError:
        health_body = health.text[:200]
    return {"stats": stats, "health": health_body}


async def bench_server(
    server: servers.Server, args: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    async with server:
        # Warm-up: up to 8 requests of the real shape (8 tokens each), so neither measured run pays first-use costs.
        warm = make_plans(args, vocab, 99, False)[:8]
        async with httpx.AsyncClient(base_url=server.base_url, timeout=args.run_timeout) as client:
            async with anyio.create_task_group() as tg:
                for plan in warm:
                    tg.start_soon(run_stream, client, plan, 8, time.perf_counter())
        runs: dict[str, list[dict[str, Any]]] = {"with_cancels": [], "baseline": []}
        for i in range(args.rounds):
            order = ("with_cancels", "baseline") if i % 2 == 0 else ("baseline", "with_cancels")
            for name in order:
                print(f"  round {i + 1}/{args.rounds}: {name.replace('_', ' ')} ...", flush=True)
                seed = args.seed + 1 + 2 * i + (name == "baseline")  # fresh prompts every run
                runs[name].append(
                    await one_run(
                        server.base_url, make_plans(args, vocab, seed, name != "baseline"), args
                    )
                )
        after = await settle(server.base_url)
    return {name: merge(parts) for name, parts in runs.items()} | {"after": after}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the records and the histograms of several runs; keep the first timeline."""
    lag: dict[str, float] = {}
    gap: dict[str, float] = {}
    for part in parts:
        for le, n in part["loop_lag_buckets"].items():
            lag[le] = lag.get(le, 0.0) + n
        for le, n in part.get("checkpoint_gap_buckets", {}).items():
            gap[le] = gap.get(le, 0.0) + n
    return {
        "wall_s": round(sum(p["wall_s"] for p in parts), 3),
        "records": [r for p in parts for r in p["records"]],
        "timeline": parts[0]["timeline"],
        "loop_lag_buckets": lag,
        "checkpoint_gap_buckets": gap,
        "rounds": len(parts),
    }


def run(args: argparse.Namespace) -> int:
    from .reference_model import ensure_reference_model

    model = args.model or str(ensure_reference_model())
    vocab = vocab_size_of(model)
    result: dict[str, Any] = {
        "benchmark": "cancel",
        "machine": machine.describe(),
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("func",) and not callable(v)
        },
        "runs": [],
    }
    result["config"]["model"] = model
    for threads in [int(t) for t in args.threads.split(",")]:
        audit = args.log_dir / f"cancel-audit-{threads}-{int(time.time())}.jsonl"
        extra = ["--max-num-seqs", str(max(64, args.requests)), *args.server_arg]
        server = servers.kvscope_server(
            model,
            threads=threads,
            dtype=args.dtype,
            audit_log=audit,
            log_path=args.log_dir / f"cancel-serve-{threads}.log",
            extra=extra,
        )
        print(
            f"kvscope serve, {threads} model thread(s): {args.requests} streams of "
            f"{args.prompt_tokens} prompt tokens ...",
            flush=True,
        )
        try:
            raw = anyio.run(bench_server, server, args, vocab)
        except Exception:
            print(f"server log tail:\n{server.log_tail()}", flush=True)
            raise
        run_figures = figures(raw, read_audit(audit))
        run_figures["threads"] = threads
        result["runs"].append(run_figures)
    result["machine"]["load_average_at_end"] = machine.load_average()
    print()
    print(cancel_tables(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    if args.plot:
        from .plots import plot_cancel

        plot_cancel(result["runs"][0], args.plot)
        print(f"wrote {args.plot}")
    failed = [r for r in result["runs"] if not r["leak_free"]]
    return 1 if failed else 0
