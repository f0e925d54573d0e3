"""matplotlib for the benchmarks' PNG plots, imported only when a plot is asked for."""

from __future__ import annotations


def pyplot():  # -> matplotlib.pyplot
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kvscope[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
