"""The text tables `bench throughput` prints (markdown, so they paste into docs/benchmarks)."""

from __future__ import annotations

from ..core.tables import table
from .records import (
    SERVED_COST_LIMIT,
    EngineRun,
    Level,
    ServedRun,
    ThroughputResult,
    level_of,
    with_speculation,
)


def _tps(levels: list[Level], c: int) -> float | None:
    level = level_of(levels, c)
    return None if level is None else level.tokens_per_s


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def served_systems(r: ThroughputResult, *, versions: bool = False) -> list[tuple[str, ServedRun]]:
    """Every served run with its name in the tables (the peers' versions where asked),
    the weights it held where recorded."""
    vllm = f"vLLM CPU {r.machine.vllm or ''}".strip() if versions else "vLLM CPU"
    llama = f"llama.cpp {r.machine.llama_cpp or ''}".strip() if versions else "llama.cpp"
    systems = [(run.label, run) for run in r.kvscope_serve]
    systems += [(run.named(vllm), run) for run in r.vllm]
    return systems + [(run.named(llama), run) for run in r.llama_cpp]


def tokens_table(r: ThroughputResult) -> list[str]:
    conc = r.config.concurrency
    rows: list[list[object]] = [
        [f"{label} (HTTP)", run.threads, *[_tps(run.levels, c) for c in conc]]
        for label, run in served_systems(r, versions=True)
    ]
    for engine in r.kvscope:
        label = with_speculation("kvscope (engine API, in-process)", engine.speculative)
        rows.append([label, engine.threads, *[_tps(engine.levels, c) for c in conc]])
    for hf in r.transformers:
        one = hf.one_at_a_time.tokens_per_s
        static = {b.batch: b.tokens_per_s for b in hf.static_batch}
        rows.append(
            [
                "transformers generate, one at a time",
                hf.threads,
                *[one if c == 1 else None for c in conc],
            ]
        )
        rows.append(
            ["transformers generate, static batch", hf.threads, *[static.get(c) for c in conc]]
        )
    headers = ["system", "threads", *[f"{c} concurrent" for c in conc]]
    return ["Output tokens/s (higher is better)", "", table(headers, rows)]  # fmt: skip


def latency_table(r: ThroughputResult) -> list[str]:
    rows = []
    systems: list[tuple[str, ServedRun | EngineRun]]
    systems = [(f"{label} (HTTP)", run) for label, run in served_systems(r)]
    systems += [
        (with_speculation("kvscope (engine API)", run.speculative), run) for run in r.kvscope
    ]
    for label, run in systems:
        for lv in run.levels:
            ttft, itl = lv.ttft_ms, lv.itl_ms
            cpu = "-" if lv.client_cpu_s is None else lv.client_cpu_s
            row = [label, run.threads, lv.concurrency, ttft.p50, ttft.p99, itl.p50, itl.p99]
            rows.append([*row, cpu, _pct(lv.client_cpu_share)])
    headers = ["system", "threads", "concurrent", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    return [
        "",
        "Latency (ms); the HTTP client's CPU seconds and share of the machine over the level",
        "",
        table([*headers, "client CPU s", "client share"], rows),
    ]


def _start_row(label: str, run: ServedRun) -> list[object]:
    cold, load, settings = run.cold_start, run.load_average, run.settings
    env = " ".join(f"{k}={v}" for k, v in settings.env.items()) if settings else ""
    return [
        label,
        run.threads,
        cold and cold.ready_s,
        cold and cold.first_token_s,
        (cold and cold.fully_up_s) or "-",
        load and load.before,
        load and load.after,
        "-" if run.processes_left is None else run.processes_left,
        env or "-",
    ]


def servers_table(r: ThroughputResult) -> list[str]:
    rows = [_start_row(label, run) for label, run in served_systems(r)]
    headers = ["server", "threads", "ready s", "first token s", "fully up s"]
    headers += ["load before", "load after", "processes left", "env"]
    return [
        "",
        "Servers: seconds from spawning to answering, to the first token, and to being fully "
        "up (the model worker process ready, or the thread worker warmed up; the levels wait "
        "for it); load average around the phase; the server's children still there once it "
        "exited on SIGTERM",
        "",
        table(headers, rows),
    ]


def overhead_table(r: ThroughputResult) -> list[str]:
    rows = [
        [
            run.threads,
            f.batch,
            f.steps,
            f.step_ms,
            f.runner_ms,
            f.model_forward_ms,
            _pct(f.outside_forward_share),
            _pct(f.event_loop_share),
        ]
        for run in r.kvscope
        for f in run.step_overhead.values()
    ]
    headers = ["threads", "batch", "steps", "step ms", "runner ms", "model forward ms"]
    headers += ["outside forward", "outside runner (event loop)"]
    return ["", "Step loop overhead (decode steps, medians)", "", table(headers, rows)]


def paired_table(r: ThroughputResult) -> list[str]:
    if not r.paired:
        return []
    rows = [
        [run.threads, run.worker, lv.concurrency, run.rounds,
         max(lv.served_tokens_per_s), max(lv.engine_tokens_per_s),
         " ".join(f"{x:.3f}" for x in lv.ratios), lv.ratio_median, lv.within_limit]
        for run in r.paired
        for lv in run.levels
    ]  # fmt: skip
    headers = ["threads", "worker", "concurrent", "rounds", "served tok/s (best)"]
    headers += ["engine tok/s (best)", "served / engine, by round", "median"]
    headers += [f"within {100 * SERVED_COST_LIMIT:.0f}%?"]
    return [
        "",
        "The serving path's cost: kvscope serve against the engine in-process, both up and "
        "taking turns (each first in every other round), so both see the same machine",
        "",
        table(headers, rows),
    ]


def headline_tables(r: ThroughputResult) -> list[str]:
    if r.headline is None:
        return []
    rows = [
        [t, c, h.vllm_compared_with or "-", f.kvscope_serve_tokens_per_s, f.vllm_tokens_per_s,
         f.x_vllm, f.target_vllm_met,
         f.kvscope_serve_ttft_p50_ms, f.vllm_ttft_p50_ms, f.ttft_no_worse, f.engine_tokens_per_s]
        for t, h in r.headline.by_threads.items()
        for c, f in h.levels.items()
    ]  # fmt: skip
    headers = ["threads", "concurrent", "kvscope serve run", "kvscope serve tok/s", "vLLM tok/s"]
    headers += ["x vLLM", ">= vLLM?"]
    headers += ["kvscope TTFT p50", "vLLM TTFT p50", "TTFT no worse?", "engine tok/s"]
    out = [
        "",
        "Targets: kvscope served against vLLM served (the engine in-process beside, not a target)",
        "",
        table(headers, rows),
    ]
    x_rows = [
        [t, h.x_transformers_one_at_a_time, h.target_3x_transformers_met]
        for t, h in r.headline.by_threads.items()
        if h.x_transformers_one_at_a_time is not None
    ]
    if x_rows:
        top = r.headline.concurrency
        out += [
            "",
            f"kvscope (served where run) at {top} concurrent against transformers one at a time",
            "",
            table(["threads", "x transformers", ">= 3x?"], x_rows),
        ]
    return out


def llama_cpp_table(r: ThroughputResult) -> list[str]:
    if r.headline is None:
        return []
    rows = [
        [t, c, h.llama_cpp_compared_with, f.kvscope_serve_tokens_per_s, f.peer_tokens_per_s,
         f.x_peer, f.kvscope_serve_ttft_p50_ms, f.peer_ttft_p50_ms, f.ttft_no_worse]
        for t, h in r.headline.by_threads.items()
        for c, f in h.llama_cpp.items()
    ]  # fmt: skip
    if not rows:
        return []
    headers = ["threads", "concurrent", "kvscope serve run", "kvscope tok/s", "llama.cpp tok/s"]
    headers += ["x llama.cpp", "kvscope TTFT p50", "llama.cpp TTFT p50", "TTFT no worse?"]
    return [
        "",
        "kvscope served against llama.cpp's llama-server on the same GGUF file",
        "",
        table(headers, rows),
    ]


def speculation_tables(r: ThroughputResult) -> list[str]:
    """With a speculative config: kvscope serve with it against without it (and the
    vLLM run it is compared with), and each speculating server's draft counts."""
    if r.headline is None or r.config.speculative_config is None:
        return []
    rows = [
        [t, c, h.vllm_compared_with, f.kvscope_serve_tokens_per_s, f.no_speculation_tokens_per_s,
         f.x_no_speculation, h.vllm_run or "-", f.vllm_tokens_per_s, f.x_vllm]
        for t, h in r.headline.by_threads.items()
        for c, f in h.levels.items()
    ]  # fmt: skip
    headers = ["threads", "concurrent", "kvscope serve run", "tok/s", "tok/s without"]
    headers += ["x without", "vLLM run", "vLLM tok/s", "x vLLM"]
    counts = []
    for label, run in served_systems(r):
        spec = run.spec_decode or {}
        drafted = spec.get("vllm:spec_decode_num_draft_tokens")
        accepted = spec.get("vllm:spec_decode_num_accepted_tokens")
        if run.speculative:
            rate = None if not drafted or accepted is None else round(accepted / drafted, 3)
            counts.append([label, run.threads, spec.get("vllm:spec_decode_num_drafts"),
                           drafted, accepted, rate])  # fmt: skip
    out = ["", f"Speculation: {_spec_json(r)}, kvscope serve with it and without", ""]
    out.append(table(headers, rows))
    if counts:
        headers = ["server", "threads", "drafts", "draft tokens", "accepted", "acceptance"]
        out += ["", "Drafts over the run (warm-up included)", "", table(headers, counts)]
    return out


def _spec_json(r: ThroughputResult) -> str:
    import json

    return json.dumps(r.config.speculative_config)


def _model_line(r: ThroughputResult) -> list[str]:
    config = r.config
    if config.model_weights is None:
        return []
    peer = config.peer_model or "none given (--peer-model)"
    return [f"Model: {config.model} ({config.model_weights}); vLLM and transformers: {peer}"]


def _sampling_line(r: ThroughputResult) -> str:
    config = r.config
    if config.temperature == 0:
        line = "Requests: greedy, ignore_eos"
    else:
        top_p = f", top_p {config.top_p:g}" if config.top_p < 1 else ""
        line = f"Requests: sampled at temperature {config.temperature:g}{top_p}, ignore_eos"
    return line + _workload_words(r)


def _workload_words(r: ThroughputResult) -> str:
    """The workload and the speculation, so no figure is read without them."""
    config = r.config
    if config.workload == "reuse":
        lengths = "-".join(map(str, config.prompt_tokens_range or []))
        words = f"; workload reuse (repeat a code snippet; prompts of {lengths or '?'} tokens)"
    else:
        words = f"; workload random ({config.prompt_tokens} prompt tokens)"
    spec = config.speculative_config
    return words + ("; no speculation" if spec is None else f"; speculative config {_spec_json(r)}")


def throughput_tables(r: ThroughputResult) -> str:
    out = [r.machine.summary(), *_model_line(r), _sampling_line(r), ""]
    out += tokens_table(r) + latency_table(r) + servers_table(r) + overhead_table(r)
    out += paired_table(r) + headline_tables(r) + speculation_tables(r) + llama_cpp_table(r)
    out += [f"\nPEER MISSING: {peer}: {why}" for peer, why in r.missing.items()]
    return "\n".join(out)
