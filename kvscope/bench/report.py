"""The text tables the benchmarks print (markdown, so they paste into docs/benchmarks)."""

from __future__ import annotations

from typing import Any

from .stats import table


def throughput_tables(r: dict[str, Any]) -> str:
    conc = r["config"]["concurrency"]
    rows = []
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
    for run in r["kvscope"]:
        rows.append(
            [
                "kvscope (engine API, in-process)",
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
        ("kvscope serve (HTTP)", r.get("kvscope_serve", [])),
        ("vLLM CPU (HTTP)", r.get("vllm", [])),
        ("kvscope (engine API)", r["kvscope"]),
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
                        lv.get("client_cpu_s", "-"),
                        _pct(lv["client_cpu_share"]) if "client_cpu_share" in lv else "-",
                    ]
                )
    out += [
        "",
        "Latency (ms); the HTTP client's CPU seconds and share of the machine over the level",
        "",
        table(
            [
                "system",
                "threads",
                "concurrent",
                "TTFT p50",
                "TTFT p99",
                "ITL p50",
                "ITL p99",
                "client CPU s",
                "client share",
            ],
            lat,
        ),
    ]
    starts = []
    for label, runs in (
        ("kvscope serve", r.get("kvscope_serve", [])),
        ("vLLM CPU", r.get("vllm", [])),
    ):
        for run in runs:
            load = run.get("load_average", {})
            starts.append(
                [
                    label,
                    run["threads"],
                    run["cold_start"]["ready_s"],
                    run["cold_start"]["first_token_s"],
                    load.get("before"),
                    load.get("after"),
                    " ".join(f"{k}={v}" for k, v in run["settings"]["env"].items()) or "-",
                ]
            )
    out += [
        "",
        "Servers: seconds from spawning to answering and to the first token; load average around the phase",
        "",
        table(
            ["server", "threads", "ready s", "first token s", "load before", "load after", "env"],
            starts,
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
        for c, f in h["levels"].items():
            hrows.append(
                [
                    t,
                    c,
                    f["kvscope_serve_tokens_per_s"],
                    f["vllm_tokens_per_s"],
                    f["x_vllm"],
                    f.get("target_vllm_met"),
                    f["kvscope_serve_ttft_p50_ms"],
                    f["vllm_ttft_p50_ms"],
                    f.get("ttft_no_worse"),
                    f["engine_tokens_per_s"],
                ]
            )
    out += [
        "",
        "Targets: kvscope served against vLLM served (the engine in-process beside, not a target)",
        "",
        table(
            [
                "threads",
                "concurrent",
                "kvscope serve tok/s",
                "vLLM tok/s",
                "x vLLM",
                ">= vLLM?",
                "kvscope TTFT p50",
                "vLLM TTFT p50",
                "TTFT no worse?",
                "engine tok/s",
            ],
            hrows,
        ),
    ]
    xrows = [
        [t, h.get("x_transformers_one_at_a_time"), h.get("target_3x_transformers_met")]
        for t, h in head.get("by_threads", {}).items()
        if "x_transformers_one_at_a_time" in h
    ]
    if xrows:
        out += [
            "",
            f"kvscope (served where run) at {head.get('concurrency')} concurrent against transformers one at a time",
            "",
            table(["threads", "x transformers", ">= 3x?"], xrows),
        ]
    for peer, why in r.get("missing", {}).items():
        out.append(f"\nPEER MISSING: {peer}: {why}")
    return "\n".join(out)


def _tps(levels: list[dict[str, Any]], c: int) -> float | None:
    return next((lv["tokens_per_s"] for lv in levels if lv["concurrency"] == c), None)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
