"""The `kvscope` command: `serve` (the main job), `generate` and `bench`.

This module owns the dispatch to the subcommands and `generate`; the engine options
they share come from `kvscope.options` (derived from `EngineConfig`), `serve` lives
in `kvscope.serve` and `bench` in `kvscope.bench.cli`.
"""

from __future__ import annotations

import argparse
import logging
import sys

import anyio

from kvscope.options import add_engine_arguments, engine_kwargs


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt")
    # The terminal's own choices, not SamplingParams' defaults: a short, repeatable demo.
    parser.add_argument("--max-tokens", type=int, default=64, help="default 64")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="default 0: greedy, the same text each run"
    )
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
    except (InvalidRequest, ValueError, TypeError) as exc:  # bad settings, ModelLoadError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    from kvscope import serve

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
