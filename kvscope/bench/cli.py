"""`kvscope bench` (placeholder until the benchmarks land)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvscope bench is not built yet")
