"""The text tables the benchmarks print (markdown, so they paste into docs/benchmarks)."""

from __future__ import annotations

from typing import Any

from .stats import table


def throughput_tables(r: dict[str, Any]) -> str:
    conc = r["config"]["concurrency"]
    rows = []
    for run in r["kvscope"]:
        rows.append(
            ["kvscope (engine API)", run["threads"], *[_tps(run["levels"], c) for c in conc]]
        )
    for run in r.get("kvscope_serve", []):
        rows.append(
            ["kvscope serve (HTTP)", run["threads"], *[_tps(run["levels"], c) for c in conc]]
        )
    for run in r.get("vllm", []):
        rows.append(
            [
                f"vLLM CPU {r['machine'].get('vllm', '')} (HTTP)",
                run["threads"],
                *[_tps(run["levels"], c) for c in conc],
            ]
        )
    for run in r.get("transformers", []):
        one = run["one_at_a_time"]["tokens_per_s"]
        rows.append(
            [
                "transformers generate, one at a time",
                run["threads"],
                *[one if c == 1 else None for c in conc],
            ]
        )
        static = {b["batch"]: b["tokens_per_s"] for b in run["static_batch"]}
        rows.append(
            ["transformers generate, static batch", run["threads"], *[static.get(c) for c in conc]]
        )
    out = [
        "Output tokens/s (higher is better)",
        "",
        table(["system", "threads", *[f"{c} concurrent" for c in conc]], rows),
    ]

    lat = []
    for label, runs in (
        ("kvscope (engine API)", r["kvscope"]),
        ("kvscope serve (HTTP)", r.get("kvscope_serve", [])),
        ("vLLM CPU (HTTP)", r.get("vllm", [])),
    ):
        for run in runs:
            for lv in run["levels"]:
                lat.append(
                    [
                        label,
                        run["threads"],
                        lv["concurrency"],
                        lv["ttft_ms"]["p50"],
                        lv["ttft_ms"]["p99"],
                        lv["itl_ms"]["p50"],
                        lv["itl_ms"]["p99"],
                    ]
                )
    out += [
        "",
        "Latency (ms)",
        "",
        table(
            ["system", "threads", "concurrent", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], lat
        ),
    ]

    over = []
    for run in r["kvscope"]:
        for batch, f in run["step_overhead"].items():
            over.append(
                [
                    run["threads"],
                    int(batch),
                    f["steps"],
                    f["step_ms"],
                    f["runner_ms"],
                    f["model_forward_ms"],
                    _pct(f["outside_forward_share"]),
                    _pct(f["event_loop_share"]),
                ]
            )
    out += [
        "",
        "Step loop overhead (decode steps, medians)",
        "",
        table(
            [
                "threads",
                "batch",
                "steps",
                "step ms",
                "runner ms",
                "model forward ms",
                "outside forward",
                "outside runner (event loop)",
            ],
            over,
        ),
    ]

    head = r.get("headline", {})
    hrows = []
    for t, h in head.get("by_threads", {}).items():
        hrows.append(
            [
                t,
                h.get("kvscope_tokens_per_s"),
                h.get("x_transformers_one_at_a_time"),
                h.get("target_3x_transformers_met"),
                h.get("vllm_tokens_per_s"),
                h.get("x_vllm"),
                h.get("target_vllm_met"),
            ]
        )
    out += [
        "",
        f"Targets at {head.get('concurrency')} concurrent",
        "",
        table(
            [
                "threads",
                "kvscope tok/s",
                "x transformers 1-at-a-time",
                ">= 3x?",
                "vLLM tok/s",
                "x vLLM",
                ">= vLLM?",
            ],
            hrows,
        ),
    ]
    for peer, why in r.get("missing", {}).items():
        out.append(f"\nPEER MISSING: {peer}: {why}")
    return "\n".join(out)


def _tps(levels: list[dict[str, Any]], c: int) -> float | None:
    return next((lv["tokens_per_s"] for lv in levels if lv["concurrency"] == c), None)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
