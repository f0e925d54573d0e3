"""The engine's figures (`Engine.stats()`): KV blocks by state, requests by state and
by end, steps, the prefix cache's counts, leaked tasks, the model worker, the warm-up
and the history of ended requests, each read from the actor that owns it.
"""

from __future__ import annotations

from .lifecycle import Actors
from .speculation import Speculation


def engine_stats(actors: Actors) -> dict[str, int]:
    pool = actors.step.pool.stats()
    counts = actors.ledger.counts
    return {
        "kv_blocks_total": pool.total,
        "kv_blocks_free": pool.free,
        "kv_blocks_in_use": pool.in_use,
        "kv_blocks_cached": pool.cached,
        "running": actors.scheduler.num_running,
        "waiting": actors.scheduler.num_waiting,
        "live_requests": actors.registry.num_live,
        "finished": counts["finished"],
        "cancelled": counts["cancelled"],
        "failed": counts["failed"],
        "steps": actors.step.steps,
        "prompt_tokens_admitted": actors.scheduler.prompt_tokens_admitted,
        "prompt_tokens_reused": actors.scheduler.prompt_tokens_reused,
        # Request tasks running now, counted by the tasks themselves as they enter
        # and leave (the step actor is not counted): 0 when nothing leaked.
        "tasks": actors.ledger.tasks,
        # The model worker process (0 and 0 with worker="thread").
        "worker_pid": actors.step.runner.pid or 0,
        "worker_restarts": actors.step.runner.restarts,
        # Row buckets the thread worker's idle warm-up has still to build (0 once
        # done, and with a model worker process, which warms up before it is ready).
        "warm_up_pending": 0 if actors.step.warm_up is None else len(actors.step.warm_up.pending),
        # The memory this process's copy of the model holds: 0 once a model worker
        # process has taken over (it holds its own).
        "model_bytes": actors.step.runner.model_bytes,
        # Ended requests kept for look-up by id, and about the bytes they hold.
        "history": actors.registry.num_retained,
        "history_bytes": actors.registry.retained_bytes,
        **speculation_stats(actors.step.speculation),
    }


def speculation_stats(speculation: Speculation | None) -> dict[str, int]:
    """Speculative decoding's counts (all 0 with it off): drafts verified, their
    tokens and the accepted ones (vLLM's `vllm:spec_decode_*`; by position in the
    draft: `StepStatistics.spec_accepted_per_position`)."""
    if speculation is None:
        return dict.fromkeys(
            (
                "spec_decode_num_drafts",
                "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens",
            ),
            0,
        )
    return {
        "spec_decode_num_drafts": speculation.num_drafts,
        "spec_decode_num_draft_tokens": speculation.num_draft_tokens,
        "spec_decode_num_accepted_tokens": speculation.num_accepted_tokens,
    }
