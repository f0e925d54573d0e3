"""`kvscope serve`: its flags (the model, the server's, vLLM's, the replicas', the
engine's) and the choice it makes once they are parsed: one server
(`kvscope.web.serve`) or engine replicas on Ray Serve (`kvscope.replicas.cli`).

It sits above both, so that neither imports the other: the replicas serve the single
server's app, and the single server knows nothing of Ray.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvscope.options import DEFAULT_MODEL, add_engine_arguments, engine_kwargs
from kvscope.web.serve import (
    SERVED_WORKER,
    SERVED_WORKER_CORES,
    add_server_arguments,
    serve_one,
    settings_from,
)
from kvscope.web.vllm_flags import add_vllm_arguments, vllm_refusals

#: Where each Ray Serve replica runs the forward: a thread, since a replica is a
#: process of its own already; on every core, since the replicas on one machine would
#: each take the same ones (one server's defaults: `kvscope.web.serve`).
REPLICA_WORKER = "thread"
REPLICA_WORKER_CORES = "all"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (or --model; bundled unless given)",
    )
    add_server_arguments(parser)
    add_replica_arguments(parser)
    add_vllm_arguments(parser)
    add_engine_arguments(
        parser,
        defaults={
            "worker": (None, f"{SERVED_WORKER}; {REPLICA_WORKER} with --replicas"),
            "worker_cores": (
                None,
                f"{SERVED_WORKER_CORES}; {REPLICA_WORKER_CORES} with --replicas",
            ),
        },
    )


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    replicas = parser.add_argument_group("replicas on Ray Serve (pip install 'kvscope[ray]')")
    replicas.add_argument(
        "--replicas", type=int, default=0, help="serve N engine replicas through Ray Serve"
    )
    replicas.add_argument("--ray-address", default=None, help="join this Ray cluster")
    replicas.add_argument("--ray-cpus", type=int, default=None, help="CPUs of a local Ray")
    replicas.add_argument("--cpus-per-replica", type=float, default=1.0)
    replicas.add_argument(
        "--request-timeout", type=float, default=None, help="Ray Serve's end-to-end timeout (s)"
    )
    replicas.add_argument(
        "--prefix-routing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send prompts that share a prefix to one replica where load allows",
    )


def with_worker_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with `--worker` and `--worker-cores`, where not given, as one server's or
    as a replica's (with `--replicas`)."""
    if args.worker is None:
        args.worker = REPLICA_WORKER if args.replicas else SERVED_WORKER
    if args.worker_cores is None:
        args.worker_cores = REPLICA_WORKER_CORES if args.replicas else SERVED_WORKER_CORES
    return args


def run(args: argparse.Namespace) -> int:
    with_worker_defaults(args)
    if args.model_tag is not None and args.model not in (None, args.model_tag):
        print(
            f"error: the model is given twice: {args.model_tag} and --model {args.model}",
            file=sys.stderr,
        )
        return 2
    args.model = args.model_tag or args.model or DEFAULT_MODEL
    refusal = vllm_refusals(args)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if not args.log_requests:
        logging.getLogger("kvscope.requests").setLevel(logging.WARNING)
    try:
        settings = settings_from(args)
        kwargs = engine_kwargs(args)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.replicas:
        from kvscope.replicas.cli import run as run_replicas  # imports Ray only here

        return run_replicas(args, settings, kwargs)
    return serve_one(args.model, settings, kwargs)
