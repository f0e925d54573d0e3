"""`kvscope bench`: the subcommands `throughput` and `cancel` (DESIGN section 6).

Each prints markdown tables, and writes `--json PATH` and `--plot PATH` when asked.
The heavy modules are imported only when their subcommand runs.
"""

from __future__ import annotations

import argparse


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
