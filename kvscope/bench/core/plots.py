"""matplotlib for the benchmarks' PNG plots, imported only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot():  # -> matplotlib.pyplot
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kvscope[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Write `fig` to `path` (a PNG) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
