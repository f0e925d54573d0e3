"""The benchmarks' PNG plots (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kvscope[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(r: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    conc = r["config"]["concurrency"]
    series: list[tuple[str, list[float | None]]] = []
    for run in r["kvscope"]:
        series.append(
            (f"kvscope engine, {run['threads']}T", [_tps(run["levels"], c) for c in conc])
        )
    for run in r.get("kvscope_serve", []):
        series.append((f"kvscope serve, {run['threads']}T", [_tps(run["levels"], c) for c in conc]))
    for run in r.get("vllm", []):
        series.append((f"vLLM CPU, {run['threads']}T", [_tps(run["levels"], c) for c in conc]))
    for run in r.get("transformers", []):
        static = {b["batch"]: b["tokens_per_s"] for b in run["static_batch"]}
        one = run["one_at_a_time"]["tokens_per_s"]
        series.append(
            (f"HF generate, {run['threads']}T", [one if c == 1 else static.get(c) for c in conc])
        )
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series):
        xs = [j + i * width for j in range(len(conc))]
        ax.bar(xs, [v or 0 for v in values], width, label=label)
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(conc))], [f"{c} concurrent" for c in conc]
    )
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput (HF generate: one at a time at 1, static batch above)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cancel(f: dict[str, Any], path: Path) -> None:
    """KV blocks in use over time (cancels marked) and the survivors' latency CDFs."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ("with_cancels", "baseline"):
        series = [(t, b) for t, b in f["kv_timeline"][name] if b is not None]
        if series:
            ax1.plot(
                [t for t, _ in series],
                [b for _, b in series],
                label=f"KV blocks in use, {name.replace('_', ' ')}",
            )
    for i, t in enumerate(f["cancel_times"]):
        ax1.axvline(t, color="red", alpha=0.3, linewidth=0.8, label="a cancel" if i == 0 else None)
    ax1.set_xlabel("seconds since the run started")
    ax1.set_ylabel("KV blocks in use")
    ax1.legend(fontsize=8)
    ax1.set_title("KV blocks in use over time")
    samples = f["samples_ms"]
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tps(levels: list[dict[str, Any]], c: int) -> float | None:
    return next((lv["tokens_per_s"] for lv in levels if lv["concurrency"] == c), None)
