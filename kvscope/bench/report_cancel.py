"""The text tables `bench cancel` prints (markdown, so they paste into docs/benchmarks)."""

from __future__ import annotations

from typing import Any

from .stats import fmt, table


def cancel_tables(result: dict[str, Any]) -> str:
    out = []
    for f in result["runs"]:
        c = result["config"]
        out.append(
            f"kvscope serve, {f['threads']} model thread(s): {f['requests']} concurrent streams of "
            f"{c['prompt_tokens']} prompt tokens + {c['max_tokens']} output tokens; "
            f"{f['deletes']} cancelled by DELETE, {f['disconnects']} by closing the stream"
        )
        rows = [
            [
                "DELETE round trip",
                f["delete_rtt_ms"]["p50"],
                f["delete_rtt_ms"]["p99"],
                f["delete_rtt_ms"]["max"],
                f"status {f['delete_status']}",
            ],
            [
                "cancel -> KV released (CancelReport)",
                f["cancel_to_release_ms_report"]["p50"],
                f["cancel_to_release_ms_report"]["p99"],
                f["cancel_to_release_ms_report"]["max"],
                f"{f['cancels_waited_for_step']} of {f['cancel_reports']} waited for a running step",
            ],
            [
                "cancel -> KV released (audit log, all cancels)",
                f["cancel_to_release_ms_audit"]["p50"],
                f["cancel_to_release_ms_audit"]["p99"],
                f["cancel_to_release_ms_audit"]["max"],
                "",
            ],
            [
                "disconnect -> cancel (audit log)",
                f["disconnect_to_cancel_ms"]["p50"],
                f["disconnect_to_cancel_ms"]["p99"],
                f["disconnect_to_cancel_ms"]["max"],
                f"one step ~ {fmt(f['step_ms_baseline_itl_p50'])} ms; reasons {f['disconnect_cancel_reasons']}",
            ],
        ]
        lag_c, lag_b = f["loop_lag"]["with_cancels"], f["loop_lag"]["baseline"]
        rows.append(
            [
                "event-loop lag (server monitor)",
                lag_c["p50_ms"],
                lag_c["p99_ms"],
                None,
                f"baseline p99 {fmt(lag_b['p99_ms'])} ms; {lag_c['samples']} samples, bucket resolution",
            ]
        )
        gap_c, gap_b = f["checkpoint_gap"]["with_cancels"], f["checkpoint_gap"]["baseline"]
        rows.append(
            [
                "checkpoint gap (forward, server histogram)",
                gap_c["p50_ms"],
                gap_c["p99_ms"],
                None,
                f"baseline p50/p99 {fmt(gap_b['p50_ms'])}/{fmt(gap_b['p99_ms'])} ms; {gap_c['samples']} gaps, bucket resolution",
            ]
        )
        out += ["", table(["figure (ms)", "p50", "p99", "max", "note"], rows)]
        sv = f["survivors"]
        srows = []
        for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "inter-token")):
            w, wo = sv[key]["with_cancels"], sv[key]["without"]
            srows.append(
                [
                    name,
                    w["p50"],
                    wo["p50"],
                    sv[key]["ratio_p50"],
                    w["p99"],
                    wo["p99"],
                    sv[key]["ratio_p99"],
                ]
            )
        out += [
            "",
            f"Survivors ({f['survivor_count']} requests, the same positions in both runs), ms",
            "",
            table(
                ["", "p50 with", "p50 without", "ratio", "p99 with", "p99 without", "ratio"], srows
            ),
        ]
        lk = f["leaked"]
        out += [
            "",
            f"After the run: KV blocks in use {fmt(lk['kv_blocks_in_use'])}, live requests "
            f"{fmt(lk['live_requests'])}, running {fmt(lk['running'])}, waiting {fmt(lk['waiting'])}, "
            f"tasks {fmt(lk['tasks']) if lk['tasks'] is not None else 'not reported by the server'}",
        ]
        trows = [
            [name, _value(t["value"]), t.get("bound", ""), t["met"]]
            for name, t in f["targets"].items()
        ]
        out += ["", "Targets", "", table(["target", "measured", "bound", "met"], trows), ""]
        if f["errors"]:
            out.append(f"ERRORS: {f['errors'][:5]}")
    return "\n".join(out)


def _value(v: Any) -> str:
    return (
        "0 leaked"
        if isinstance(v, dict) and not any(v.values())
        else fmt(v)
        if not isinstance(v, dict)
        else str(v)
    )
