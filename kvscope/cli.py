"""The `kvscope` command: `serve` (the main job), `generate` and `bench`.

This module owns the argument parsing shared by every subcommand (model, device,
dtype, backend, cache and scheduler limits) and `generate`; `serve` lives in
`kvscope.web.serve` and `bench` in `kvscope.bench.cli`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import anyio
import attrs

from kvscope.config import EngineConfig

#: `EngineConfig` limits that `kvscope serve` and `generate` take as flags of the same
#: name (defaults from `EngineConfig`, the one place they are set).
LIMIT_SETTINGS = (
    "max_request_depth",
    "max_family_size",
    "max_prompt_bytes",
    "tokenize_in_thread_bytes",
    "finished_history",
    "finished_history_bytes",
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model", default="bundled", help="bundled | tiny-random | a Hugging Face checkpoint dir"
    )
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    group.add_argument(
        "--backend", default="asyncio", choices=["asyncio", "trio"], help="event loop"
    )
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--kv-cache-tokens", type=int, default=65_536)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=512)
    group.add_argument("--max-queued-requests", type=int, default=4096)
    group.add_argument(
        "--model-threads", type=int, default=None, help="torch threads for the model step"
    )
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument(
        "--seed", type=int, default=0, help="engine seed (random weights, unseeded sampling)"
    )
    group.add_argument("--log-level", default="INFO")
    limits = parser.add_argument_group("limits on what a client controls (docs/security.md)")
    defaults = EngineConfig()
    for name in LIMIT_SETTINGS:
        limits.add_argument(
            "--" + name.replace("_", "-"), type=int, default=getattr(defaults, name)
        )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `Engine.open` keyword arguments that `add_engine_arguments` parsed."""
    config = EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued_requests=args.max_queued_requests,
        model_threads=args.model_threads,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        audit_log=getattr(args, "audit_log", None),
        **{name: getattr(args, name) for name in LIMIT_SETTINGS},
    )
    return {"model": args.model, "device": args.device, "dtype": args.dtype, **attrs.asdict(config)}


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None)
    add_engine_arguments(parser)


def run_generate(args: argparse.Namespace) -> int:
    from kvscope import Engine, InvalidRequest

    async def main() -> None:
        async with Engine.open(**engine_kwargs(args)) as engine:
            async with engine.request(
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.sample_seed,
            ) as request:
                sys.stdout.write(args.prompt)
                async for delta in request:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            result = request.result
            print(
                f"[{result.finish_reason}: {result.prompt_tokens} prompt + "
                f"{result.completion_tokens} generated tokens]",
                file=sys.stderr,
            )

    try:
        anyio.run(main, backend=args.backend)
    except InvalidRequest as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    from kvscope.web import serve

    serve.add_arguments(commands.add_parser("serve", help="serve the HTTP API (the main job)"))
    add_generate_arguments(
        commands.add_parser("generate", help="stream a completion to the terminal")
    )
    # `bench` is listed here but parsed by `kvscope.bench.cli`, and only when it runs:
    # the benchmarks import what only the `bench` extra installs.
    commands.add_parser("bench", help="run a benchmark (needs: pip install 'kvscope[bench]')")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from kvscope.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        return serve.run(args)
    if args.command == "generate":
        logging.getLogger("kvscope.requests").setLevel(logging.WARNING)
        return run_generate(args)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
