"""Turning one `bench cancel` run's raw records into its figures and target checks.

Sources: the client's clock (DELETE round trip, TTFT, inter-token gaps, when a stream
was closed), the CancelReport each DELETE returned (`release_seconds`,
`waited_for_step`), the server's audit log (cancelled and released wall times of
every request, so also of the ones cancelled by a disconnect), `/metrics` (the event
loop lag histogram over the run) and `/stats` (KV blocks over time, and after the run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import prometheus
from .stats import ratio, summary


def read_audit(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[record["id"]] = record
    return records


def _latency(records: list[dict[str, Any]], indices: set[int]) -> tuple[list[float], list[float]]:
    ttft: list[float] = []
    itl: list[float] = []
    for r in records:
        if r["index"] in indices and r["token_times"]:
            ttft.append(r["token_times"][0] - r["start"])
            itl.extend(b - a for a, b in zip(r["token_times"], r["token_times"][1:], strict=False))
    return ttft, itl


def _lag(run: dict[str, Any], key: str = "loop_lag_buckets") -> dict[str, Any]:
    buckets = {float(k): v for k, v in run.get(key, {}).items()}
    q = lambda x: None if x is None else round(x * 1e3, 3)  # noqa: E731
    return {
        "samples": prometheus.count(buckets),
        "p50_ms": q(prometheus.quantile(buckets, 0.5)),
        "p99_ms": q(prometheus.quantile(buckets, 0.99)),
        "share_at_most_2_5ms": prometheus.share_at_most(buckets, 0.0025),
    }


def figures(raw: dict[str, Any], audit: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cancelled, baseline = raw["with_cancels"], raw["baseline"]
    recs = cancelled["records"]
    keep = {r["index"] for r in recs if r["action"] == "keep"}
    deletes = [r for r in recs if r["action"] == "delete" and "delete_rtt" in r]
    disconnects = [r for r in recs if r["action"] == "disconnect" and "closed_wall" in r]
    reports = [r["report"] for r in deletes if isinstance(r.get("report"), dict)]

    audit_release: list[float] = []
    disconnect_cancel: list[float] = []
    disconnect_reasons: dict[str | None, int] = {}
    for r in deletes + disconnects:
        a = audit.get(r.get("id") or "")
        if a and a.get("cancelled") is not None and a.get("released") is not None:
            audit_release.append(a["released"] - a["cancelled"])
        if r["action"] == "disconnect" and a:
            reason = a.get("cancel_reason") or a.get("finish_reason")
            disconnect_reasons[reason] = disconnect_reasons.get(reason, 0) + 1
            if a.get("cancelled") is not None:
                disconnect_cancel.append(a["cancelled"] - r["closed_wall"])

    ttft_c, itl_c = _latency(recs, keep)
    ttft_b, itl_b = _latency(baseline["records"], keep)
    itl_b_all = _latency(baseline["records"], {r["index"] for r in baseline["records"]})[1]
    s = lambda v: summary(v, 1e3)  # noqa: E731
    out: dict[str, Any] = {
        "requests": len(recs),
        "survivor_count": len(keep),
        "deletes": len(deletes),
        "disconnects": len(disconnects),
        "errors": [r.get("error") for r in recs + baseline["records"] if r.get("error")],
        "wall_s": {"with_cancels": cancelled["wall_s"], "baseline": baseline["wall_s"]},
        "delete_status": _counts(r["delete_status"] for r in deletes),
        "delete_rtt_ms": s([r["delete_rtt"] for r in deletes]),
        "cancel_to_release_ms_report": s(
            [x["release_seconds"] for x in reports if x.get("release_seconds") is not None]
        ),
        "cancel_to_release_ms_audit": s(audit_release),
        "cancels_waited_for_step": sum(1 for x in reports if x.get("waited_for_step")),
        "cancel_reports": len(reports),
        "blocks_released_per_cancel": summary([x.get("blocks_released", 0) for x in reports])[
            "mean"
        ],
        "disconnect_to_cancel_ms": s(disconnect_cancel),
        "disconnect_cancel_reasons": disconnect_reasons,
        "step_ms_baseline_itl_p50": s(itl_b_all)["p50"],
        "survivors": {
            "ttft_ms": {"with_cancels": s(ttft_c), "without": s(ttft_b)},
            "itl_ms": {"with_cancels": s(itl_c), "without": s(itl_b)},
        },
        "loop_lag": {"with_cancels": _lag(cancelled), "baseline": _lag(baseline)},
        "checkpoint_gap": {
            name: _lag(run, "checkpoint_gap_buckets")
            for name, run in (("with_cancels", cancelled), ("baseline", baseline))
        },
        "after": raw["after"],
        "kv_timeline": {
            "with_cancels": [(p["t"], p.get("kv_blocks_in_use")) for p in cancelled["timeline"]],
            "baseline": [(p["t"], p.get("kv_blocks_in_use")) for p in baseline["timeline"]],
        },
        "cancel_times": sorted(r["cancel_at"] for r in deletes + disconnects),
        "samples_ms": {
            name: [round(x * 1e3, 3) for x in v]
            for name, v in (
                ("ttft_with", ttft_c),
                ("ttft_without", ttft_b),
                ("itl_with", itl_c),
                ("itl_without", itl_b),
            )
        },
    }
    sv = out["survivors"]
    for key in ("ttft_ms", "itl_ms"):
        sv[key]["ratio_p50"] = ratio(sv[key]["with_cancels"]["p50"], sv[key]["without"]["p50"])
        sv[key]["ratio_p99"] = ratio(sv[key]["with_cancels"]["p99"], sv[key]["without"]["p99"])
    stats = raw["after"]["stats"]
    tasks = stats.get(
        "tasks",
        raw["after"]["health"].get("tasks") if isinstance(raw["after"]["health"], dict) else None,
    )
    out["leaked"] = {
        "kv_blocks_in_use": stats.get("kv_blocks_in_use"),
        "live_requests": stats.get("live_requests"),
        "running": stats.get("running"),
        "waiting": stats.get("waiting"),
        "tasks": tasks,
    }
    out["leak_free"] = (
        all(v in (0, None) for v in out["leaked"].values()) and stats.get("kv_blocks_in_use") == 0
    )
    out["targets"] = targets(out)
    return out


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def targets(f: dict[str, Any]) -> dict[str, Any]:
    """Each target of issue 5: the figure, the bound and whether it is met (None: not measured)."""

    def check(value: float | None, bound: float) -> dict[str, Any]:
        return {"value": value, "bound": bound, "met": None if value is None else value <= bound}

    step = f["step_ms_baseline_itl_p50"]
    return {
        "delete_rtt_p99_ms<=5": check(f["delete_rtt_ms"]["p99"], 5),
        "cancel_to_release_p50_ms<=0.5": check(f["cancel_to_release_ms_report"]["p50"], 0.5),
        "cancel_to_release_p99_ms<=10": check(f["cancel_to_release_ms_report"]["p99"], 10),
        "disconnect_to_cancel_p99<=one_step": check(
            f["disconnect_to_cancel_ms"]["p99"], step or 0.0
        ),
        "survivor_itl_p99_ratio<=1.05": check(f["survivors"]["itl_ms"]["ratio_p99"], 1.05),
        "event_loop_lag_p99_ms<=2": check(f["loop_lag"]["with_cancels"]["p99_ms"], 2),
        "leaked==0": {"value": f["leaked"], "met": f["leak_free"]},
    }
