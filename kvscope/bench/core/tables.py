"""Markdown tables (they paste into docs/benchmarks and read in a terminal)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable in a terminal)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    out = [line(list(headers)), "| " + " | ".join("-" * w for w in widths) + " |"]
    out.extend(line(r) for r in cells)
    return "\n".join(out)
