"""`kvscope bench`: the subcommands `throughput` and `cancel` (DESIGN section 6).

Each prints markdown tables, and writes `--json PATH` and `--plot PATH` when asked.
The benchmarks need the `bench` extra; without it `main` says what to install and
exits 2 before importing anything heavy. The heavy modules are imported only when
their subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules the benchmarks import that only the `bench` extra installs.
BENCH_MODULES = ("aiohttp", "httpx", "transformers")
INSTALL_HINT = "pip install 'kvscope[bench]'"


def missing_modules() -> list[str]:
    missing = []
    for name in BENCH_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: list[str]) -> int:
    missing = missing_modules()
    if missing:
        print(
            f"kvscope bench needs the bench extra ({', '.join(missing)} missing): {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    parser = argparse.ArgumentParser(prog="kvscope bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from . import cancel, throughput

    sub = parser.add_subparsers(dest="bench", required=True)
    throughput.add_arguments(
        sub.add_parser("throughput", help="output tokens/s vs transformers and vLLM")
    )
    cancel.add_arguments(
        sub.add_parser("cancel", help="cancel half of many streams via DELETE; latency and release")
    )


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("kvscope.requests").setLevel(logging.WARNING)  # one line per request
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request
    if args.bench == "throughput":
        from . import throughput

        return throughput.run(args)
    from . import cancel

    return cancel.run(args)
