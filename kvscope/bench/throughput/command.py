"""`kvscope bench throughput`: output tokens/s, served against served.

For each torch thread count (default 1 and 2), on the reference model (or `--model`: a
checkpoint directory, or a GGUF file) and the same prompt token ids, each phase alone on
the machine: `kvscope serve`, vLLM's CPU build (where installed) and llama.cpp's
`llama-server` (where given, on a GGUF file), all driven over HTTP by the same light
client on the same route (streaming `/v1/completions`; `served.py`); kvscope's engine
in-process, as its own row (never the target); `transformers` `generate` one request at
a time and as a static batch. vLLM and transformers serve a checkpoint directory: for a
GGUF model, `--peer-model` (the same weights, `kvscope bench convert`). kvscope serve
runs once per `--serve-dtype` (a GGUF file: as the file holds its weights, `auto`, and
dequantized to bfloat16). The headline compares kvscope served with vLLM and with
llama.cpp served at every concurrency (tokens/s and TTFT p50), with the first
`--worker` given and the weights the peer serves; every other run is its own row.
What the serving path costs against the engine in-process is measured apart, with both
up at once and taking turns (`paired.py`), as the machine's speed drifts between phases.
Also: the step loop's overhead, the client's CPU seconds per level, the time
from spawning `kvscope serve` to its first token, and the load average around each
phase. Prints tables, writes `--json` and `--plot`. The peers' modules are imported
only when their phase runs.

The prompts are `--workload`'s: distinct random token ids (`core/workload.py`), or
chats whose answers repeat their prompt's code (`core/reuse_workload.py`). A
`--speculative-config` (vLLM's JSON) goes as is to every kvscope run and to vLLM, and
kvscope serve also runs without it, so its speedup comes from one run; each row, the
record and the tables name the workload and whether the row speculated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import attrs

from ..core import gguf_model, machine, servers
from ..core.options import ints
from ..core.reuse_workload import reuse_prompts
from ..core.workload import Workload, make_prompts, vocab_size_of
from .arguments import add_arguments, check_arguments, peers_of, serve_dtypes
from .engine_run import run_engine
from .headline import headline
from .paired import run_paired
from .records import Config, PairedRun, ServedRun, ThroughputResult, with_speculation
from .served import run_served
from .tables import throughput_tables

#: `kvscope bench` calls `add_arguments` (from `arguments.py`) and `run` of this module.
__all__ = ["add_arguments", "run"]


def sampling_of(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling fields every system's requests send."""
    sampling = {"temperature": args.temperature}
    if args.top_p < 1.0:
        sampling["top_p"] = args.top_p
    return sampling


def build_levels(args: argparse.Namespace, model: str) -> list[tuple[int, Workload]]:
    """Each concurrency's workload: `--workload`'s prompts, max(c, --min-requests) of them."""
    levels = []
    start = 0  # the reuse workload's snippets are named apart over the whole run
    for c in ints(args.concurrency):
        count = max(c, args.min_requests)
        if args.workload == "reuse":
            reuse = reuse_prompts(model, count, args.max_tokens, seed=1000 + c, start=start)
            prompts = [p.token_ids for p in reuse]
        else:
            prompts = make_prompts(count, args.prompt_tokens, vocab_size_of(model), seed=1000 + c)
        start += count
        levels.append((c, Workload(prompts, args.max_tokens, sampling_of(args))))
    return levels


def speculations(args: argparse.Namespace) -> list[bool | None]:
    """How kvscope serve runs: with the speculative config, then without it (the
    baseline, in the same run); None where no config is given."""
    return [None] if args.speculative_config is None else [True, False]


def _kvscope_server(
    args: argparse.Namespace,
    model: str,
    threads: int,
    worker: str,
    dtype: str,
    phase: str,
    speculative: bool | None = None,
) -> servers.Server:
    extra = ["--max-num-seqs", str(max(ints(args.concurrency)))]
    if speculative:
        extra += ["--speculative-config", args.speculative_config]
    how = {None: "", True: "-spec", False: "-nospec"}[speculative]
    return servers.kvscope_server(
        model,
        threads=threads,
        dtype=dtype,
        log_path=args.log_dir / f"kvscope-{phase}-{threads}-{worker}-{dtype}{how}.log",
        worker=worker,
        extra=extra,
    )


def serve_phase(
    args: argparse.Namespace,
    model: str,
    levels,
    threads: int,
    worker: str,
    dtype: str,
    weights: str | None,
    speculative: bool | None = None,
) -> ServedRun:
    server = _kvscope_server(args, model, threads, worker, dtype, "serve", speculative)
    held = f", weights {weights}" if weights else ""
    how = with_speculation("", speculative)
    print(
        f"kvscope serve (HTTP), {threads} thread(s), {worker} worker, --dtype {dtype}"
        f"{held}{how} ...",
        flush=True,
    )
    run = partial(run_served, speculative=speculative)
    timeout = args.level_timeout
    served = anyio.run(run, server, None, levels, timeout, "kvscope serve", threads)
    return attrs.evolve(served, worker=worker, dtype=dtype, weights=weights)


def paired_phase(args: argparse.Namespace, model: str, levels, threads: int) -> PairedRun:
    worker = args.worker.split(",")[0].strip()  # the headline's
    speculative = None if args.speculative_config is None else True
    server = _kvscope_server(args, model, threads, worker, args.dtype, "paired", speculative)
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
        speculative_config=args.speculative_config,
    )
    return anyio.run(run)


def config_of(args: argparse.Namespace, model: str, levels, model_weights: str | None) -> Config:
    sampling = levels[0][1].sampling  # what the requests sent, recorded from them
    lengths = [len(p) for _, w in levels for p in w.prompts]
    spec = args.speculative_config
    return Config(
        model=model,
        dtype=args.dtype,
        prompt_tokens=args.prompt_tokens if args.workload == "random" else None,
        workload=args.workload,
        prompt_tokens_range=[min(lengths), max(lengths)],
        speculative_config=None if spec is None else json.loads(spec),
        max_tokens=args.max_tokens,
        concurrency=ints(args.concurrency),
        requests_per_level={str(c): w.num_requests for c, w in levels},
        threads=ints(args.threads),
        hf_requests=args.hf_requests,
        temperature=sampling["temperature"],
        top_p=sampling.get("top_p", 1.0),
        peer_model=None if args.peer_model is None else str(args.peer_model),
        model_weights=model_weights,
    )


def peer_dir(args: argparse.Namespace, model: str, model_file: Path | None) -> str | None:
    """The checkpoint directory vLLM and transformers serve: `--peer-model`, else the
    model where it is one (None for a GGUF file without `--peer-model`)."""
    if args.peer_model is not None:
        return str(args.peer_model)
    return model if model_file is None and Path(model).is_dir() else None


def kvscope_serve_runs(
    args: argparse.Namespace, model: str, levels, file_weights: str | None
) -> list[ServedRun]:
    """kvscope serve at every thread count, worker, dtype and speculation (in that
    nesting); `file_weights`: how the model's GGUF file holds its weights (None: no
    GGUF file)."""
    return [
        serve_phase(
            args,
            model,
            levels,
            t,
            worker.strip(),
            dtype,
            gguf_model.served_weights(file_weights, dtype),
            speculative,
        )
        for t in ints(args.threads)
        for worker in args.worker.split(",")
        for dtype in serve_dtypes(args, gguf=file_weights is not None)
        for speculative in speculations(args)
    ]


def measure(args: argparse.Namespace, model: str) -> ThroughputResult:
    """Every phase asked for, one after the other; the result without its headline."""
    model_file = gguf_model.gguf_file(model)
    file_weights = None if model_file is None else gguf_model.weight_type(model_file)
    peer = peer_dir(args, model, model_file)
    levels = build_levels(args, model)
    peers = peers_of(args)
    started, t0 = machine.describe(), time.perf_counter()
    missing: dict[str, str] = {}
    engine_runs = []
    for threads in ints(args.threads):
        print(f"kvscope engine, {threads} thread(s) ...", flush=True)
        spec = args.speculative_config
        engine = partial(run_engine, model, threads, levels, dtype=args.dtype)
        engine = partial(engine, speculative_config=spec, timeout=args.level_timeout)
        engine_runs.append(anyio.run(engine))
    served = []
    if "kvscope-serve" in peers:
        served = kvscope_serve_runs(args, model, levels, file_weights)
    paired = []
    if "kvscope-serve" in peers and args.paired_rounds > 0:
        paired = [paired_phase(args, model, levels, t) for t in ints(args.threads)]
    hf = []
    if "transformers" in peers:
        from .hf_peer import hf_phase

        hf = hf_phase(args, peer, vocab_size_of(model), levels, missing)
    vllm, vllm_version = vllm_runs(args, peer, levels, missing, file_weights, peers)
    llama_cpp, llama_cpp_version = llama_cpp_runs(
        args, model_file, levels, missing, file_weights, peers
    )
    ended = attrs.evolve(started.ended(), vllm=vllm_version, llama_cpp=llama_cpp_version)
    return ThroughputResult(
        machine=ended,
        config=config_of(args, model, levels, file_weights),
        kvscope=engine_runs,
        missing=missing,
        kvscope_serve=served,
        vllm=vllm,
        llama_cpp=llama_cpp,
        transformers=hf,
        paired=paired,
        elapsed_s=round(time.perf_counter() - t0, 1),
    )


def vllm_runs(
    args: argparse.Namespace,
    peer: str | None,
    levels: list[tuple[int, Workload]],
    missing: dict[str, str],
    file_weights: str | None,
    peers: set[str],
) -> tuple[list[ServedRun], str | None]:
    if "vllm" not in peers:
        return [], None
    from .vllm_peer import VLLM_DTYPE, vllm_phase

    weights = gguf_model.served_weights(file_weights, VLLM_DTYPE)
    return vllm_phase(args, peer, levels, missing, weights)


def llama_cpp_runs(
    args: argparse.Namespace,
    model_file: Path | None,
    levels: list[tuple[int, Workload]],
    missing: dict[str, str],
    file_weights: str | None,
    peers: set[str],
) -> tuple[list[ServedRun], str | None]:
    if "llama.cpp" not in peers:
        return [], None
    from .llamacpp_peer import llama_cpp_phase

    weights = gguf_model.served_weights(file_weights, "auto")  # the file as it is
    return llama_cpp_phase(args, model_file, levels, missing, weights)


def run(args: argparse.Namespace) -> int:
    from ..core.reference_model import ensure_reference_model

    if why := check_arguments(args):
        print(f"kvscope bench throughput: {why}", file=sys.stderr)
        return 2
    model = gguf_model.resolve(args.model) if args.model else str(ensure_reference_model())
    result = measure(args, model)
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
