"""`kvscope bench throughput`: output tokens/s, served against served.

For each torch thread count (default 1 and 2), on the reference model and the same
prompt token ids, each phase alone on the machine: `kvscope serve` and vLLM's CPU build
(where installed), both driven over HTTP by the same light client on the same route
(streaming `/v1/completions`); kvscope's engine in-process, as its own row (never the
target); `transformers` `generate` one request at a time and as a static batch. The
headline compares kvscope served with vLLM served at every concurrency (tokens/s and
TTFT p50), with the first `--worker` given; each other worker is its own served row.
What the serving path costs against the engine in-process is measured apart, with both
up at once and taking turns (`paired.py`), as the machine's speed drifts between phases.
Also: the step loop's overhead, the client's CPU seconds per level, the time
from spawning `kvscope serve` to its first token, and the load average around each
phase. Prints tables, writes `--json` and `--plot`. The peers' modules are imported
only when their phase runs.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import attrs

from kvscope.web.serve import SERVED_WORKER

from ..core import machine, servers
from ..core.options import add_common_arguments, ints
from ..core.workload import Workload, make_prompts, vocab_size_of
from .engine_run import run_engine
from .headline import headline
from .http_level import run_http_level
from .paired import run_paired
from .records import ColdStart, Config, HfRun, LoadAround, PairedRun, ServedRun, ThroughputResult
from .tables import throughput_tables


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, threads="1,2")
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
        "--temperature",
        type=float,
        default=0.0,
        help="every system's requests sample at this temperature (default 0: greedy)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="and keep this top-p nucleus (default 1: all)"
    )
    p.add_argument(
        "--hf-requests", type=int, default=4, help="requests for transformers one at a time"
    )
    p.add_argument(
        "--worker",
        default=SERVED_WORKER,
        help="where kvscope serve runs the model: thread, process (comma-separated, each "
        "measured; the first is the one the headline compares with vLLM)",
    )
    p.add_argument(
        "--paired-rounds",
        type=int,
        default=3,
        help="rounds of kvscope serve (the first --worker) and the engine in-process "
        "taking turns at each level, for the serving path's cost (0 skips)",
    )
    p.add_argument(
        "--peers",
        default="kvscope-serve,vllm,transformers",
        help="peers to run: kvscope-serve,vllm,transformers (or none)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of the venv vLLM's CPU build is installed in "
        "(default: $KVSCOPE_VLLM_PYTHON or /root/vllm-venv/bin/python)",
    )
    p.add_argument(
        "--level-timeout", type=float, default=600, help="seconds before a level is abandoned"
    )


def sampling_of(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling fields every system's requests send."""
    sampling = {"temperature": args.temperature}
    if args.top_p < 1.0:
        sampling["top_p"] = args.top_p
    return sampling


def build_levels(args: argparse.Namespace, vocab: int) -> list[tuple[int, Workload]]:
    levels = []
    for c in ints(args.concurrency):
        count = max(c, args.min_requests)
        prompts = make_prompts(count, args.prompt_tokens, vocab, seed=1000 + c)
        levels.append((c, Workload(prompts, args.max_tokens, sampling_of(args))))
    return levels


async def _http_peer(
    server: servers.Server,
    model: str | None,
    levels: list[tuple[int, Workload]],
    timeout: float,
    label: str,
    threads: int,
) -> ServedRun:
    """Start `server`, time its cold start to a first token, then run every level."""
    from ..core.http import served_model

    out = []
    before = machine.load_average()
    async with server:
        model = model or await served_model(server.base_url)
        warm = Workload([levels[0][1].prompts[0][::-1]], 4)  # a prompt none of the levels uses
        first = await run_http_level(server.base_url, model, warm, 1, timeout)
        assert server.spawned_at is not None and server.ready_at is not None
        ready = server.ready_at - server.spawned_at
        # The first request is sent once the server is ready: its TTFT is added.
        first_token = ready + (first.ttft_ms.p50 or 0) / 1e3
        fully_up = await server.settled()
        cold = ColdStart(
            ready_s=round(ready, 2),
            first_token_s=round(first_token, 2),
            fully_up_s=None if fully_up is None else round(fully_up, 2),
        )
        print(f"  {label} threads={threads} cold start: {cold}", flush=True)
        for c, workload in levels:
            level = await run_http_level(server.base_url, model, workload, c, timeout)
            out.append(level)
            print(
                f"  {label} threads={threads} concurrency={c}: {level.tokens_per_s:.0f} tok/s, "
                f"ITL p50 {level.itl_ms.p50} ms, client CPU {level.client_cpu_s} s",
                flush=True,
            )
    return ServedRun(
        threads=threads,
        levels=out,
        cold_start=cold,
        settings=server.settings,
        load_average=LoadAround(before=before, after=machine.load_average()),
        processes_left=len(server.left_behind),  # counted once it has stopped
    )


def _kvscope_server(
    args: argparse.Namespace, model: str, threads: int, worker: str, phase: str = "serve"
) -> servers.Server:
    return servers.kvscope_server(
        model,
        threads=threads,
        dtype=args.dtype,
        log_path=args.log_dir / f"kvscope-{phase}-{threads}-{worker}.log",
        worker=worker,
        extra=["--max-num-seqs", str(max(ints(args.concurrency)))],
    )


def serve_phase(
    args: argparse.Namespace, model: str, levels, threads: int, worker: str
) -> ServedRun:
    server = _kvscope_server(args, model, threads, worker)
    print(f"kvscope serve (HTTP), {threads} thread(s), {worker} worker ...", flush=True)
    timeout = args.level_timeout
    run = anyio.run(_http_peer, server, None, levels, timeout, "kvscope serve", threads)
    return attrs.evolve(run, worker=worker)


def paired_phase(args: argparse.Namespace, model: str, levels, threads: int) -> PairedRun:
    worker = args.worker.split(",")[0].strip()  # the headline's
    server = _kvscope_server(args, model, threads, worker, phase="paired")
    print(
        f"kvscope serve and the engine in-process, interleaved, {threads} thread(s), "
        f"{worker} worker, {args.paired_rounds} rounds ...",
        flush=True,
    )
    run = partial(
        run_paired,
        server,
        model,
        levels,
        threads=threads,
        worker=worker,
        dtype=args.dtype,
        rounds=args.paired_rounds,
        timeout=args.level_timeout,
    )
    return anyio.run(run)


def hf_phase(
    args: argparse.Namespace, model: str, vocab: int, levels, missing: dict[str, str]
) -> list[HfRun]:
    from . import hf_peer

    why = (
        hf_peer.available()
        or (None if Path(model).is_dir() else "transformers needs a checkpoint dir, not " + model)
        or (None if args.temperature == 0 else "its runs are greedy only (--temperature 0)")
    )
    if why:
        missing["transformers"] = why
        print(f"transformers peer MISSING: {why}", flush=True)
        return []
    prompts = make_prompts(args.hf_requests, args.prompt_tokens, vocab, seed=3)
    batches = [(c, w) for c, w in levels if c > 1]
    runs = []
    for threads in ints(args.threads):
        print(f"transformers, {threads} thread(s) ...", flush=True)
        one = Workload(prompts, args.max_tokens)
        runs.append(hf_peer.run_hf(model, threads, one, batches, dtype=args.dtype))
    return runs


def vllm_phase(
    args: argparse.Namespace, model: str, levels, missing: dict[str, str]
) -> tuple[list[ServedRun], str | None]:
    """vLLM served at every thread count, and its version (None if it did not run)."""
    from . import vllm_peer

    python = args.vllm_python or vllm_peer.DEFAULT_VLLM_PYTHON
    why = vllm_peer.vllm_missing(python) if Path(model).is_dir() else "vLLM needs a checkpoint dir"
    if why:
        missing["vllm"] = why
        print(f"vLLM peer MISSING: {why}", flush=True)
        return [], None
    runs = []
    for threads in ints(args.threads):
        log = args.log_dir / f"vllm-{threads}.log"
        server = vllm_peer.vllm_server(python, model, threads=threads, log_path=log)
        print(f"vLLM CPU, {threads} thread(s) (starting takes about a minute) ...", flush=True)
        timeout = args.level_timeout
        try:
            runs.append(
                anyio.run(_http_peer, server, "reference", levels, timeout, "vLLM", threads)
            )
        except (RuntimeError, TimeoutError) as exc:
            missing[f"vllm threads={threads}"] = f"{exc}; log: {server.log_path}"
            print(f"vLLM failed: {exc}\n{server.log_tail()}", flush=True)
    return runs, vllm_peer.vllm_version(python)


def config_of(args: argparse.Namespace, model: str, levels) -> Config:
    sampling = levels[0][1].sampling  # what the requests sent, recorded from them
    return Config(
        model=model,
        dtype=args.dtype,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        concurrency=ints(args.concurrency),
        requests_per_level={str(c): w.num_requests for c, w in levels},
        threads=ints(args.threads),
        hf_requests=args.hf_requests,
        temperature=sampling["temperature"],
        top_p=sampling.get("top_p", 1.0),
    )


def measure(args: argparse.Namespace, model: str) -> ThroughputResult:
    """Every phase asked for, one after the other; the result without its headline."""
    vocab = vocab_size_of(model)
    levels = build_levels(args, vocab)
    peers = {p.strip() for p in args.peers.split(",")} - {"", "none"}
    started, t0 = machine.describe(), time.perf_counter()
    missing: dict[str, str] = {}
    engine_runs = []
    for threads in ints(args.threads):
        print(f"kvscope engine, {threads} thread(s) ...", flush=True)
        engine = partial(run_engine, model, threads, levels, dtype=args.dtype)
        engine_runs.append(anyio.run(partial(engine, timeout=args.level_timeout)))
    served = []
    if "kvscope-serve" in peers:
        served = [
            serve_phase(args, model, levels, t, worker.strip())
            for t in ints(args.threads)
            for worker in args.worker.split(",")
        ]
    paired = []
    if "kvscope-serve" in peers and args.paired_rounds > 0:
        paired = [paired_phase(args, model, levels, t) for t in ints(args.threads)]
    hf = hf_phase(args, model, vocab, levels, missing) if "transformers" in peers else []
    vllm, vllm_version = vllm_phase(args, model, levels, missing) if "vllm" in peers else ([], None)
    return ThroughputResult(
        machine=attrs.evolve(started.ended(), vllm=vllm_version),
        config=config_of(args, model, levels),
        kvscope=engine_runs,
        missing=missing,
        kvscope_serve=served,
        vllm=vllm,
        transformers=hf,
        paired=paired,
        elapsed_s=round(time.perf_counter() - t0, 1),
    )


def run(args: argparse.Namespace) -> int:
    from ..core.reference_model import ensure_reference_model

    result = measure(args, args.model or str(ensure_reference_model()))
    result = attrs.evolve(result, headline=headline(result))
    print()
    print(throughput_tables(result))
    if args.json:
        result.to_json(args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        from .plot import plot_throughput

        plot_throughput(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
