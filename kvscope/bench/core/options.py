"""The options both benchmarks take, with their defaults written once."""

from __future__ import annotations

import argparse
from pathlib import Path

#: The dtypes a benchmark may run kvscope in (`auto`: the checkpoint's own).
DTYPES = ("auto", "float32", "bfloat16")


def add_common_arguments(p: argparse.ArgumentParser, *, threads: str) -> None:
    """--model, --dtype, --threads (default `threads`), --log-dir, --json, --plot."""
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint dir or tiny-random (default: the reference Llama, built on first use)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument(
        "--threads",
        default=threads,
        help="torch threads for the model (comma-separated, each measured)",
    )
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kvscope-bench"))
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG here (needs matplotlib)")


def ints(text: str) -> list[int]:
    """`"1,8,32"` -> [1, 8, 32]."""
    return [int(x) for x in text.split(",") if x.strip()]
