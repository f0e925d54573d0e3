"""`bench cancel`'s plot: KV blocks in use over time, and the survivors' latency CDFs."""

from __future__ import annotations

from pathlib import Path

from ..core.plots import pyplot, save
from .records import CancelRun


def plot_cancel(f: CancelRun, path: Path) -> None:
    """KV blocks in use over time (cancels marked) and the survivors' latency CDFs."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ("with_cancels", "baseline"):
        series = [(t, b) for t, b in f.kv_timeline[name] if b is not None]
        if series:
            ax1.plot(
                [t for t, _ in series],
                [b for _, b in series],
                label=f"KV blocks in use, {name.replace('_', ' ')}",
            )
    for i, t in enumerate(f.cancel_times):
        ax1.axvline(t, color="red", alpha=0.3, linewidth=0.8, label="a cancel" if i == 0 else None)
    ax1.set_xlabel("seconds since the run started")
    ax1.set_ylabel("KV blocks in use")
    ax1.legend(fontsize=8)
    ax1.set_title("KV blocks in use over time")
    samples = f.samples_ms
    for key, label, style in (
        ("itl_with", "inter-token, with cancels", "-"),
        ("itl_without", "inter-token, without", "-"),
        ("ttft_with", "TTFT, with cancels", "--"),
        ("ttft_without", "TTFT, without", "--"),
    ):
        values = sorted(samples.get(key, []))
        if values:
            ax2.plot(
                values,
                [i / len(values) for i in range(1, len(values) + 1)],
                linestyle=style,
                label=label,
            )
    ax2.set_xscale("log")
    ax2.set_xlabel("ms (log scale)")
    ax2.set_ylabel("fraction of samples at or below")
    ax2.set_title("Survivors' latency distributions")
    ax2.legend(fontsize=8)
    save(fig, path)
