"""Turning one `bench cancel` run's raw records into its figures and target checks.

Sources: the client's clock (DELETE round trip, TTFT, inter-token gaps), the client's
wall clock (when a DELETE was sent and answered, when a stream was closed), the
CancelReport each DELETE returned (`release_seconds`, `in_running_step`), the server's
audit log (the `cancelled` and `released` wall times of every request, so also of the
ones cancelled by a disconnect), `/metrics` (the event-loop lag histogram over the run)
and `/stats` (KV blocks over time, and after the run).

The hops of a DELETE, in order: sent -> the engine's cancel call (`cancelled` in the
audit log) -> blocks released (`release_seconds`; `released` in the audit log) ->
answer read by the client. The first and last include the HTTP path both ways; the
server stamps no arrival time, so the request's way in is not split further. The last
is split at the CancelReport's making (`reply_seconds - release_seconds`, the server's
clock): the loop's work after the release, then writing the answer, the wire and the
client's wake-up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from ..core import prometheus
from ..core.stats import Summary, ratio, summary
from .records import (
    CancelRun,
    Client,
    Compared,
    Lag,
    Leaked,
    RawRun,
    StreamRecord,
    Survivors,
    Target,
)

#: The cancel targets (docs/benchmarks/README.md, "Cancel"): name -> (the figure it
#: bounds, the bound). `leaked==0` is added by `targets`; the disconnect bound (one step)
#: is measured, not fixed.
TARGETS: dict[str, tuple[str, float]] = {
    "delete_rtt_p50_ms<=2": ("delete_rtt_ms.p50", 2),
    "delete_rtt_p99_ms<=5": ("delete_rtt_ms.p99", 5),
    "cancel_to_release_p50_ms<=0.5": ("cancel_to_release_ms_report.p50", 0.5),
    "cancel_to_release_p99_ms<=10": ("cancel_to_release_ms_report.p99", 10),
    "event_loop_lag_p99_ms<=2": ("loop_lag.with_cancels.p99_ms", 2),
    "survivor_itl_p99_ratio<=1.05": ("survivors.itl_ms.ratio_p99", 1.05),
}


def read_audit(path: Path) -> dict[str, dict[str, Any]]:
    """The audit log's records by request id ({} if there is no log)."""
    if not path.is_file():
        return {}
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[record["id"]] = record
    return records


def ms(values: list[float]) -> Summary:
    return summary(values, 1e3)


def _latency(records: list[StreamRecord], indices: set[int]) -> tuple[list[float], list[float]]:
    """TTFT and inter-token gaps (s) of the streams at `indices`."""
    ttft: list[float] = []
    itl: list[float] = []
    for r in records:
        if r.index in indices and r.token_times:
            ttft.append(r.token_times[0] - r.start)
            itl.extend(b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False))
    return ttft, itl


def lag(run: RawRun, buckets: dict[float, float] | None = None) -> Lag:
    """Quantiles of a run's loop-lag histogram (or of `buckets`, another one's)."""
    buckets = run.loop_lag_buckets if buckets is None else buckets
    q = prometheus.quantile

    def in_ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 3)

    return Lag(
        samples=prometheus.count(buckets),
        p50_ms=in_ms(q(buckets, 0.5)),
        p99_ms=in_ms(q(buckets, 0.99)),
        share_at_most_2_5ms=prometheus.share_at_most(buckets, 0.0025),
    )


def survivors(with_cancels: RawRun, baseline: RawRun, keep: set[int]) -> Survivors:
    ttft_c, itl_c = _latency(with_cancels.records, keep)
    ttft_b, itl_b = _latency(baseline.records, keep)

    def compared(a: list[float], b: list[float]) -> Compared:
        w, wo = ms(a), ms(b)
        return Compared(
            with_cancels=w,
            without=wo,
            ratio_p50=ratio(w.p50, wo.p50),
            ratio_p99=ratio(w.p99, wo.p99),
        )

    by_round = {
        "with_cancels": _itl_p99_by_round(with_cancels, keep),
        "baseline": _itl_p99_by_round(baseline, keep),
    }
    base = [p99 for p99 in by_round["baseline"] if p99 is not None]
    return Survivors(
        ttft_ms=compared(ttft_c, ttft_b),
        itl_ms=compared(itl_c, itl_b),
        itl_p99_ms_by_round=by_round,
        itl_p99_baseline_spread=ratio(max(base), min(base)) if len(base) > 1 else None,
    )


def _itl_p99_by_round(run: RawRun, keep: set[int]) -> list[float | None]:
    """The inter-token p99 (ms) of the streams at `keep`, in each of `run`'s rounds."""
    return [
        ms(_latency([r for r in run.records if r.round == i], keep)[1]).p99
        for i in range(run.rounds)
    ]


def samples(with_cancels: RawRun, baseline: RawRun, keep: set[int]) -> dict[str, list[float]]:
    """The survivors' raw TTFT and inter-token samples (ms), for the plot."""
    (ttft_c, itl_c), (ttft_b, itl_b) = (
        _latency(with_cancels.records, keep),
        _latency(baseline.records, keep),
    )
    named = {"ttft_with": ttft_c, "ttft_without": ttft_b, "itl_with": itl_c, "itl_without": itl_b}
    return {name: [round(x * 1e3, 3) for x in v] for name, v in named.items()}


def delete_hops(deletes: list[StreamRecord], audit: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Hops 2 to 4 of the DELETEs (see the module docstring), in seconds."""
    reports = [r.report for r in deletes if r.report is not None]
    sent_to_cancelled, released_to_reply, released_to_report, report_to_reply = [], [], [], []
    for r in deletes:
        a = audit.get(r.id or "") or {}
        if a.get("cancelled") is not None and r.delete_sent_wall is not None:
            sent_to_cancelled.append(a["cancelled"] - r.delete_sent_wall)
        if a.get("released") is not None and r.delete_reply_wall is not None:
            hop = r.delete_reply_wall - a["released"]
            released_to_reply.append(hop)
            if (server := _released_to_report(r.report)) is not None:
                released_to_report.append(server)
                report_to_reply.append(hop - server)
    release = [x["release_seconds"] for x in reports if x.get("release_seconds") is not None]
    return {
        "delete_sent_to_cancelled_ms": ms(sent_to_cancelled),
        "cancel_to_release_ms_report": ms(release),
        "released_to_reply_ms": ms(released_to_reply),
        "released_to_report_ms": ms(released_to_report),
        "report_to_reply_ms": ms(report_to_reply),
        "cancels_waited_for_step": sum(1 for x in reports if x.get("in_running_step")),
        "cancel_reports": len(reports),
        "blocks_released_per_cancel": summary([x.get("blocks_released", 0) for x in reports]).mean,
    }


def _released_to_report(report: dict[str, Any] | None) -> float | None:
    """Hop 4's server part, from the CancelReport (the server's clock): the release ->
    the report made (None from a server that does not say when it made it)."""
    if not report or report.get("reply_seconds") is None or report.get("release_seconds") is None:
        return None
    return float(report["reply_seconds"]) - float(report["release_seconds"])


def audit_figures(cancels: list[StreamRecord], audit: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """cancel -> release for every cancel, and disconnect -> cancel, from the audit log."""
    release: list[float] = []
    disconnect_cancel: list[float] = []
    reasons: dict[str, int] = {}
    for r in cancels:
        a = audit.get(r.id or "")
        if not a:
            continue
        if a.get("cancelled") is not None and a.get("released") is not None:
            release.append(a["released"] - a["cancelled"])
        if r.action == "disconnect":
            reason = str(a.get("cancel_reason") or a.get("finish_reason"))
            reasons[reason] = reasons.get(reason, 0) + 1
            if a.get("cancelled") is not None and r.closed_wall is not None:
                disconnect_cancel.append(a["cancelled"] - r.closed_wall)
    return {
        "cancel_to_release_ms_audit": ms(release),
        "disconnect_to_cancel_ms": ms(disconnect_cancel),
        "disconnect_cancel_reasons": reasons,
    }


def leaked(after: dict[str, Any]) -> Leaked:
    stats, health = after["stats"], after["health"]
    tasks = stats.get("tasks", health.get("tasks") if isinstance(health, dict) else None)
    return Leaked(
        kv_blocks_in_use=stats.get("kv_blocks_in_use"),
        live_requests=stats.get("live_requests"),
        running=stats.get("running"),
        waiting=stats.get("waiting"),
        tasks=tasks,
        processes=after.get("processes_left"),
    )


def client(runs: dict[str, RawRun], cores: int) -> Client:
    return Client(
        library="aiohttp",
        cpu_s={k: round(r.client_cpu_s, 3) for k, r in runs.items()},
        cpu_share={k: round(r.client_cpu_s / (r.wall_s * cores), 4) for k, r in runs.items()},
    )


def figures(
    with_cancels: RawRun,
    baseline: RawRun,
    after: dict[str, Any],
    audit: dict[str, dict[str, Any]],
    *,
    threads: int,
    worker: str | None,
    cores: int,
) -> CancelRun:
    recs = with_cancels.records
    keep = {r.index for r in recs if r.action == "keep"}
    deletes = [r for r in recs if r.action == "delete" and r.delete_rtt is not None]
    disconnects = [r for r in recs if r.action == "disconnect" and r.closed_wall is not None]
    all_baseline = {r.index for r in baseline.records}
    timeline = {"with_cancels": with_cancels.timeline, "baseline": baseline.timeline}
    left = leaked(after)
    run = CancelRun(
        threads=threads,
        worker=worker,
        requests=len(recs),
        survivor_count=len(keep),
        deletes=len(deletes),
        disconnects=len(disconnects),
        errors=[r.error for r in recs + baseline.records if r.error],
        wall_s={"with_cancels": with_cancels.wall_s, "baseline": baseline.wall_s},
        delete_status=_counts(r.delete_status for r in deletes),
        delete_rtt_ms=ms([r.delete_rtt for r in deletes if r.delete_rtt is not None]),
        **delete_hops(deletes, audit),
        **audit_figures(deletes + disconnects, audit),
        step_ms_baseline_itl_p50=ms(_latency(baseline.records, all_baseline)[1]).p50,
        survivors=survivors(with_cancels, baseline, keep),
        loop_lag={"with_cancels": lag(with_cancels), "baseline": lag(baseline)},
        checkpoint_gap={
            "with_cancels": lag(with_cancels, with_cancels.checkpoint_gap_buckets),
            "baseline": lag(baseline, baseline.checkpoint_gap_buckets),
        },
        after=after,
        kv_timeline={
            k: [(p["t"], p.get("kv_blocks_in_use")) for p in v] for k, v in timeline.items()
        },
        cancel_times=sorted(r.cancel_at for r in deletes + disconnects if r.cancel_at is not None),
        samples_ms=samples(with_cancels, baseline, keep),
        leaked=left,
        leak_free=left.none,
        targets={},
        client=client({"with_cancels": with_cancels, "baseline": baseline}, cores),
        wake_floor_ms=ms(with_cancels.wake_floor),
        loop_cores={str(core): n for core, n in sorted(with_cancels.loop_cores.items())} or None,
    )
    return _with_targets(run)


def _counts(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def figure(run: CancelRun, path: str) -> Any:
    """The figure at a dotted `path` of `run` (a dict key or an attribute at each step)."""
    value: Any = run
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
        if value is None:
            return None
    return value


def _with_targets(run: CancelRun) -> CancelRun:
    """`run` with each cancel target: the figure, the bound, whether it is met."""

    def check(value: float | None, bound: float) -> Target:
        return Target(value=value, bound=bound, met=None if value is None else value <= bound)

    targets = {name: check(figure(run, path), bound) for name, (path, bound) in TARGETS.items()}
    targets["disconnect_to_cancel_p99<=one_step"] = check(
        run.disconnect_to_cancel_ms.p99, run.step_ms_baseline_itl_p50 or 0.0
    )
    targets["leaked==0"] = Target(value=run.leaked.as_dict(), met=run.leak_free)
    return attrs.evolve(run, targets=targets)
