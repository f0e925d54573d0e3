"""The records of `bench cancel`: what the client saw of each stream (kept in memory)
and the figures of each run (written to the JSON, read back by `bench report`).

Times the client takes for itself are `time.perf_counter()`; times it compares with
the server's audit log are wall times (`time.time()`, the same clock on one machine).
Fields added after format 1 (the hops, the worker, the client) default to None, so the
files written before still load.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..core.machine import Machine
from ..core.records import FORMAT, Record
from ..core.stats import Summary


@attrs.define(kw_only=True)
class StreamRecord:
    """One streaming request as the client saw it (perf_counter unless `_wall`)."""

    index: int
    action: str  # keep | delete | disconnect
    start: float
    token_times: list[float] = attrs.field(factory=list)
    tokens: int = 0
    http_status: int | None = None
    error: str | None = None
    id: str | None = None
    done: dict[str, Any] | None = None
    #: Seconds since the run's origin when the client cancelled (both ways of cancelling).
    cancel_at: float | None = None
    closed_wall: float | None = None
    delete_sent_wall: float | None = None
    delete_reply_wall: float | None = None
    delete_rtt: float | None = None
    delete_status: int | None = None
    #: The CancelReport the DELETE answered with (None if it was not JSON).
    report: dict[str, Any] | None = None
    #: Which of its kind's pooled runs it ran in (0: the first; `runs.merge`).
    round: int = 0


@attrs.define(kw_only=True)
class RawRun:
    """One measured run: every stream, the `/stats` samples, the loop-lag histogram
    over the run (`le` -> count), and the client's own CPU seconds."""

    wall_s: float
    records: list[StreamRecord]
    timeline: list[dict[str, Any]]
    loop_lag_buckets: dict[float, float]
    client_cpu_s: float
    rounds: int = 1
    #: The forward's gaps between cancel checkpoints (`le` -> count) over the run.
    checkpoint_gap_buckets: dict[float, float] = attrs.Factory(dict)
    #: How late a sleeping process woke beside the run (s; `core.wake_floor`).
    wake_floor: list[float] = attrs.Factory(list)
    #: Samples of the core the server's event loop last ran on (core -> samples).
    loop_cores: dict[int, int] = attrs.Factory(dict)


@attrs.frozen(kw_only=True)
class Lag(Record):
    samples: int
    p50_ms: float | None
    p99_ms: float | None
    share_at_most_2_5ms: float | None


@attrs.frozen(kw_only=True)
class Compared(Record):
    """The survivors' samples with cancels and in the baseline, and their ratios."""

    with_cancels: Summary
    without: Summary
    ratio_p50: float | None
    ratio_p99: float | None


@attrs.frozen(kw_only=True)
class Survivors(Record):
    ttft_ms: Compared
    itl_ms: Compared
    #: The inter-token p99 (ms) of each round's run of each kind, in order.
    itl_p99_ms_by_round: dict[str, list[float | None]] | None = None
    #: The baseline's slowest round's inter-token p99 over its fastest (None with one
    #: round): how much the same workload, with no cancel, varies from run to run here.
    #: A with/without ratio inside it is not resolved by the run.
    itl_p99_baseline_spread: float | None = None


@attrs.frozen(kw_only=True)
class Leaked(Record):
    """What `GET /stats` (or `/health`) showed once no request was live."""

    kv_blocks_in_use: int | None
    live_requests: int | None
    running: int | None
    waiting: int | None
    tasks: int | None
    #: The server's child processes (its model worker ...) still there after it exited
    #: on SIGTERM; None in files from before it was counted.
    processes: int | None = None

    @property
    def none(self) -> bool:
        return self.kv_blocks_in_use == 0 and all(v in (0, None) for v in attrs.astuple(self))


@attrs.frozen(kw_only=True)
class Target(Record):
    """A figure, its bound and whether it is met (None: not measured)."""

    value: Any
    met: bool | None
    bound: float | None = None


@attrs.frozen(kw_only=True)
class Client(Record):
    """The benchmark's own client: which library, and its CPU seconds per run."""

    library: str
    cpu_s: dict[str, float]
    cpu_share: dict[str, float]


@attrs.frozen(kw_only=True)
class CancelRun(Record):
    """The figures of one server setting (model threads, worker), in milliseconds."""

    threads: int
    requests: int
    survivor_count: int
    deletes: int
    disconnects: int
    errors: list[str]
    wall_s: dict[str, float]
    delete_status: dict[str, int]
    #: Hop 1, the client's clock: DELETE sent -> its answer read.
    delete_rtt_ms: Summary
    #: The CancelReport's `release_seconds`: the engine's cancel call -> blocks released.
    cancel_to_release_ms_report: Summary
    #: The audit log's `released - cancelled`, for every cancel (disconnects too).
    cancel_to_release_ms_audit: Summary
    #: Cancels whose request was in the running step (the CancelReport's
    #: `in_running_step`; `waited_for_step` before the release stopped waiting for it).
    cancels_waited_for_step: int
    cancel_reports: int
    blocks_released_per_cancel: float | None
    disconnect_to_cancel_ms: Summary
    disconnect_cancel_reasons: dict[str, int]
    step_ms_baseline_itl_p50: float | None
    survivors: Survivors
    loop_lag: dict[str, Lag]
    #: `GET /stats` and `/health` after the run, as the server answered them.
    after: dict[str, Any]
    kv_timeline: dict[str, list[tuple[float, int | None]]]
    cancel_times: list[float]
    samples_ms: dict[str, list[float]]
    leaked: Leaked
    leak_free: bool
    targets: dict[str, Target]
    # Since format 2:
    worker: str | None = None
    #: The gap between the forward's cancel checkpoints (the server's histogram).
    checkpoint_gap: dict[str, Lag] | None = None
    #: Hop 2: DELETE sent (client wall) -> the audit log's `cancelled` stamp.
    delete_sent_to_cancelled_ms: Summary | None = None
    #: Hop 4: the audit log's `released` stamp -> the DELETE's answer read (client wall).
    released_to_reply_ms: Summary | None = None
    #: Hop 4, the server's part: the release -> the CancelReport made (`reply_seconds -
    #: release_seconds`); and the rest: the report made -> the answer read.
    released_to_report_ms: Summary | None = None
    report_to_reply_ms: Summary | None = None
    client: Client | None = None
    #: How late a sleeping process woke during the run with cancels: the machine's
    #: floor under the server's loop lag and every wake-up of a hop.
    wake_floor_ms: Summary | None = None
    #: The core the server's event loop last ran on, sampled beside `/stats` during the
    #: run with cancels (core -> samples; None in older files): on a machine whose cores
    #: the benchmark's clients share, the loop's core decides the kind of run.
    loop_cores: dict[str, int] | None = None


@attrs.frozen(kw_only=True)
class CancelResult(Record):
    machine: Machine
    #: The command's options as given (`vars(args)`), the model resolved.
    config: dict[str, Any]
    runs: list[CancelRun]
    benchmark: str = "cancel"
    format: int = FORMAT
