"""`kvscope bench cancel`: the seed's cancellation scenario, scaled to this machine.

Starts the real `kvscope serve` on 127.0.0.1 (with an audit log) for each model thread
count and worker kind asked for, opens many concurrent streaming requests with long
prompts, and cancels a share of them part-way through: most by `DELETE
/requests/{id}`, some by closing the stream. Then it repeats the same workload (fresh
prompts of the same shape, so the prefix cache cannot help) with no cancels as the
baseline. Figures come from the client's clocks, the CancelReports, the audit log and
the server's `/metrics` and `/stats` (see `figures`), and are printed next to issue
10's targets, hop by hop.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import anyio

from kvscope.web.serve import SERVED_WORKER

from ..core import machine, servers
from ..core.options import add_common_arguments, ints
from ..core.workload import vocab_size_of
from .figures import figures, read_audit
from .records import CancelResult, CancelRun
from .runs import bench_server
from .tables import cancel_tables


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, threads="1")
    p.add_argument(
        "--worker",
        default=SERVED_WORKER,
        help="where the server runs the model: thread, process (comma-separated, each measured)",
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


def measure(
    args: argparse.Namespace, model: str, vocab: int, threads: int, worker: str, cores: int
) -> CancelRun:
    """One server setting: start it, run the rounds, turn the records into figures."""
    stamp = f"{threads}-{worker}-{int(time.time())}"
    audit = args.log_dir / f"cancel-audit-{stamp}.jsonl"
    extra = ["--max-num-seqs", str(max(64, args.requests)), *args.server_arg]
    server = servers.kvscope_server(
        model,
        threads=threads,
        dtype=args.dtype,
        audit_log=audit,
        log_path=args.log_dir / f"cancel-serve-{stamp}.log",
        worker=worker,
        extra=extra,
    )
    print(
        f"kvscope serve, {threads} model thread(s), worker {worker}: {args.requests} streams "
        f"of {args.prompt_tokens} prompt tokens ...",
        flush=True,
    )
    try:
        with_cancels, baseline, after = anyio.run(bench_server, server, args, vocab)
    except Exception:
        print(f"server log tail:\n{server.log_tail()}", flush=True)
        raise
    return figures(
        with_cancels,
        baseline,
        after,
        read_audit(audit),
        threads=threads,
        worker=worker,
        cores=cores,
    )


def run(args: argparse.Namespace) -> int:
    from ..core.reference_model import ensure_reference_model

    model = args.model or str(ensure_reference_model())
    vocab = vocab_size_of(model)
    started = machine.describe()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config = {k: v for k, v in config.items() if k != "func" and not callable(v)}
    runs = [
        measure(args, model, vocab, threads, worker.strip(), started.cores or 1)
        for worker in args.worker.split(",")
        for threads in ints(args.threads)
    ]
    result = CancelResult(machine=started.ended(), config=config | {"model": model}, runs=runs)
    print()
    print(cancel_tables(result))
    if args.json:
        result.to_json(args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        from .plot import plot_cancel

        plot_cancel(result.runs[0], args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r.leak_free for r in result.runs) else 1
