"""The text tables `bench cancel` prints (markdown, so they paste into docs/benchmarks).

The first table walks a cancel's path hop by hop, each figure next to its target
(`TARGETS` in `figures`; docs/benchmarks/README.md, "Cancel"); files written before
the hops were measured show "-" for them.
"""

from __future__ import annotations

from ..core.stats import Summary
from ..core.tables import fmt, table
from .records import CancelResult, CancelRun

#: Hop rows: (label, the run's Summary field, target names, note).
HOPS = (
    ("1. DELETE round trip (client)", "delete_rtt_ms", ("p50", "p99"), "delete_rtt"),
    ("2. DELETE sent -> cancelled (audit)", "delete_sent_to_cancelled_ms", (), ""),
    ("3. cancel -> KV released (CancelReport)", "cancel_to_release_ms_report", ("p50", "p99"), "cancel_to_release"),
    ("   cancel -> KV released (audit, all cancels)", "cancel_to_release_ms_audit", (), ""),
    ("4. released (audit) -> DELETE answer read", "released_to_reply_ms", (), ""),
    ("   4a. released -> report made (server)", "released_to_report_ms", (), ""),
    ("   4b. report made -> answer read", "report_to_reply_ms", (), ""),
    ("disconnect -> cancelled (audit)", "disconnect_to_cancel_ms", ("p99",), "disconnect_to_cancel"),
)  # fmt: skip


def _target(run: CancelRun, prefix: str, quantiles: tuple[str, ...]) -> str:
    """`p99<=5 no`-style text for the targets of `prefix` at `quantiles`."""
    out = []
    for name, t in run.targets.items():
        if name.startswith(prefix) and any(f"_{q}" in name for q in quantiles):
            bound = "one step" if name.endswith("one_step") else fmt(t.bound)
            quantile = next(q for q in quantiles if f"_{q}" in name)
            out.append(f"{quantile}<={bound} {fmt(t.met)}")
    return ", ".join(out)


def _hop_rows(run: CancelRun) -> list[list[object]]:
    rows: list[list[object]] = []
    for label, field, quantiles, prefix in HOPS:
        s: Summary | None = getattr(run, field)
        target = _target(run, prefix, quantiles) if prefix else ""
        rows.append([label, s and s.p50, s and s.p99, s and s.max, s and s.count, target])
    lag, base = run.loop_lag["with_cancels"], run.loop_lag["baseline"]
    lag_target = _target(run, "event_loop_lag", ("p99",))
    rows.append(
        ["event-loop lag (server monitor)", lag.p50_ms, lag.p99_ms, None, lag.samples, lag_target]
    )
    rows.append(["   the same, baseline run", base.p50_ms, base.p99_ms, None, base.samples, ""])
    if (floor := run.wake_floor_ms) is not None:
        rows.append(
            [
                "machine floor: a sleeping process wakes late",
                floor.p50,
                floor.p99,
                floor.max,
                floor.count,
                "",
            ]
        )
    if run.checkpoint_gap is not None:
        gap = run.checkpoint_gap["with_cancels"]
        rows.append(["checkpoint gap (forward)", gap.p50_ms, gap.p99_ms, None, gap.samples, ""])
    return rows  # fmt: skip


def _hop_table(run: CancelRun) -> list[str]:
    headers = ["hop (ms)", "p50", "p99", "max", "n", "target, met"]
    notes = (
        f"DELETE status {run.delete_status}; {run.cancels_waited_for_step} of "
        f"{run.cancel_reports} cancels found their request in the running step; one step ~ "
        f"{fmt(run.step_ms_baseline_itl_p50)} ms; disconnect reasons "
        f"{run.disconnect_cancel_reasons}; loop lag has bucket resolution"
        + (f"; the event loop's core (samples) {run.loop_cores}" if run.loop_cores else "")
    )
    return ["", table(headers, _hop_rows(run)), "", notes]


def _survivor_table(run: CancelRun) -> list[str]:
    rows = []
    for name, c in (("TTFT", run.survivors.ttft_ms), ("inter-token", run.survivors.itl_ms)):
        w, wo = c.with_cancels, c.without
        rows.append([name, w.p50, wo.p50, c.ratio_p50, w.p99, wo.p99, c.ratio_p99])
    target = run.targets.get("survivor_itl_p99_ratio<=1.05")
    met = f"; inter-token p99 ratio <= 1.05: {fmt(target.met)}" if target else ""
    headers = ["", "p50 with", "p50 without", "ratio", "p99 with", "p99 without", "ratio"]
    out = [
        "",
        f"Survivors ({run.survivor_count} requests, the same positions in both runs), ms{met}",
        "",
        table(headers, rows),
    ]
    by_round = run.survivors.itl_p99_ms_by_round
    if by_round and run.survivors.itl_p99_baseline_spread is not None:
        each = "; ".join(
            f"{name.replace('_', ' ')} {', '.join(fmt(p99) for p99 in p99s)}"
            for name, p99s in by_round.items()
        )
        out += [
            "",
            f"Inter-token p99 by round: {each}. The baseline's own spread (slowest round / "
            f"fastest) {fmt(run.survivors.itl_p99_baseline_spread)}: a ratio within it is "
            "not resolved by this run.",
        ]
    return out


def _footer(run: CancelRun) -> list[str]:
    lk = run.leaked
    tasks = fmt(lk.tasks) if lk.tasks is not None else "not reported by the server"
    out = [
        "",
        f"After the run: KV blocks in use {fmt(lk.kv_blocks_in_use)}, live requests "
        f"{fmt(lk.live_requests)}, running {fmt(lk.running)}, waiting {fmt(lk.waiting)}, "
        f"tasks {tasks}, processes left by the stopped server "
        f"{fmt(lk.processes) if lk.processes is not None else 'not counted'}",
    ]
    if run.client is not None:
        cpu, share = run.client.cpu_s, run.client.cpu_share
        out.append(
            f"Client ({run.client.library}) CPU s: with cancels {fmt(cpu.get('with_cancels'))} "
            f"({fmt(share.get('with_cancels'), 3)} of the machine), baseline "
            f"{fmt(cpu.get('baseline'))} ({fmt(share.get('baseline'), 3)})"
        )
    if run.errors:
        out.append(f"ERRORS: {run.errors[:5]}")
    return out


def cancel_tables(result: CancelResult) -> str:
    c = result.config
    out = [result.machine.summary()]
    for run in result.runs:
        worker = f", worker {run.worker}" if run.worker else ""
        rounds = int(c.get("rounds") or 1)  # the runs' streams are pooled over the rounds
        pooled = f" ({rounds} rounds pooled)" if rounds > 1 else ""
        out += [
            "",
            f"kvscope serve, {run.threads} model thread(s){worker}: {run.requests // rounds} "
            f"concurrent streams of {c.get('prompt_tokens')} prompt tokens + "
            f"{c.get('max_tokens')} output tokens; {run.deletes} cancelled by DELETE, "
            f"{run.disconnects} by closing the stream{pooled}",
            *_hop_table(run),
            *_survivor_table(run),
            *_footer(run),
        ]
    return "\n".join(out)
