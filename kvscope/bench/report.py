"""`kvscope bench report FILE...`: the tables of saved benchmark JSON files, again.

Each file is read into its typed record (`load`), so a file that no longer fits the
records fails here rather than in a reader's head. Files of format 2 load as written.
Files without a `format` key (format 1: written before the records, as untyped dicts)
load through `_from_v1`: their fields are those of the records, minus the ones added
since (which default to None), except the throughput headline, whose shape changed
once; it is derived from the levels, so it is recomputed. A cancel run's `worker` is
read from the `--server-arg`s it was given.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import attrs

from .cancel.records import CancelResult
from .core.records import read_json
from .throughput.records import ThroughputResult

RECORDS: dict[str, type[CancelResult] | type[ThroughputResult]] = {
    "cancel": CancelResult,
    "throughput": ThroughputResult,
}


def _from_v1(data: dict[str, Any]) -> CancelResult | ThroughputResult:
    data = {**data, "format": 1}
    if data.get("benchmark") == "throughput":
        from .throughput.headline import headline

        served = ThroughputResult.from_dict({k: v for k, v in data.items() if k != "headline"})
        return attrs.evolve(served, headline=headline(served))
    cancel = CancelResult.from_dict(data)
    worker = _worker_of(cancel.config.get("server_arg") or [])
    return attrs.evolve(cancel, runs=[attrs.evolve(r, worker=worker) for r in cancel.runs])


def _worker_of(server_args: list[str]) -> str | None:
    """The `--worker` a format-1 run passed to `kvscope serve` (None: the default then)."""
    for i, arg in enumerate(server_args):
        if arg.startswith("--worker="):
            return arg.partition("=")[2]
        if arg == "--worker" and i + 1 < len(server_args):
            return server_args[i + 1]
    return None


def load(path: Path) -> CancelResult | ThroughputResult:
    data = read_json(path)
    kind = data.get("benchmark")
    if kind not in RECORDS:
        raise ValueError(f"{path}: not a `kvscope bench` result (benchmark: {kind!r})")
    if "format" not in data:
        return _from_v1(data)
    return RECORDS[kind].from_dict(data)


def tables(result: CancelResult | ThroughputResult) -> str:
    if isinstance(result, CancelResult):
        from .cancel.tables import cancel_tables

        return cancel_tables(result)
    from .throughput.tables import throughput_tables

    return throughput_tables(result)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", type=Path, help="JSON files written by --json")


def run(args: argparse.Namespace) -> int:
    for path in args.files:
        print(f"# {path}\n")
        print(tables(load(path)))
        print()
    return 0
