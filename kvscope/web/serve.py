"""`kvscope serve` (placeholder until the server lands)."""

from __future__ import annotations

import argparse

from kvscope.cli import add_engine_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvscope serve is not built yet")
