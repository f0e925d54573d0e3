"""`bench throughput`'s plot: output tokens/s of every system at every concurrency."""

from __future__ import annotations

from pathlib import Path

from ..core.plots import pyplot, save
from .records import EngineRun, Level, ServedRun, ThroughputResult, level_of, with_speculation
from .tables import served_systems


def _series(r: ThroughputResult) -> list[tuple[str, list[float | None]]]:
    conc = r.config.concurrency
    series: list[tuple[str, list[float | None]]] = []
    runs: list[tuple[str, EngineRun | ServedRun]] = [
        (with_speculation("kvscope engine", run.speculative), run) for run in r.kvscope
    ]
    runs += served_systems(r)
    series += [
        (f"{label}, {run.threads}T", [_tps(run.levels, c) for c in conc]) for label, run in runs
    ]
    for hf in r.transformers:
        static = {b.batch: b.tokens_per_s for b in hf.static_batch}
        one = hf.one_at_a_time.tokens_per_s
        series.append(
            (f"HF generate, {hf.threads}T", [one if c == 1 else static.get(c) for c in conc])
        )
    return series


def plot_throughput(r: ThroughputResult, path: Path) -> None:
    plt = pyplot()
    conc = r.config.concurrency
    series = _series(r)
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
    save(fig, path)


def _tps(levels: list[Level], c: int) -> float | None:
    level = level_of(levels, c)
    return None if level is None else level.tokens_per_s
