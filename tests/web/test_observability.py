"""GET /stats, /metrics and /health; a drained shutdown (503 while draining)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pydantic
import pytest

from kvscope.bench.core import prometheus
from kvscope.web.schemas import Stats

from .conftest import LONG, Live, running_server, wait_clean, wait_for, wait_status, wait_tokens


def test_stats_metrics_health(live: Live) -> None:
    with live.client() as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json() == {
            "status": "ok",
            "ready": True,
            "model": "tiny-random",
        }
        done = client.post(
            "/generate", json={"prompt": "a", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        ).json()
        gone = client.post("/generate", json={"prompt": "b", **LONG}).json()
        wait_tokens(client, gone["id"])
        stats = client.get("/stats").json()
        assert set(Stats.model_json_schema()["properties"]) == set(stats)  # all documented
        assert stats["live_requests"] >= 1 and stats["kv_blocks_in_use"] >= 1
        assert stats["model_bytes"] > 0  # the model runs in this process (a thread)
        assert (
            stats["kv_blocks_total"]
            == stats["kv_blocks_free"] + stats["kv_blocks_in_use"] + stats["kv_blocks_cached"]
        )
        client.delete(f"/requests/{gone['id']}")
        wait_status(client, done["id"])
        wait_clean(live)
        stats = client.get("/stats").json()
        assert stats["kv_blocks_in_use"] == 0 and stats["cancelled"] == 1 and stats["finished"] == 1
        gone_tokens = client.get(f"/requests/{gone['id']}").json()["tokens_generated"]
        text = client.get("/metrics").text
    for needle in (
        'kvscope_requests_total{finish_reason="length"} 1.0',
        'kvscope_requests_total{finish_reason="cancelled"} 1.0',
        'kvscope_cancellations_total{reason="user"} 1.0',
        "kvscope_time_to_first_token_seconds_count 2.0",
        "kvscope_inter_token_latency_seconds_count",
        "kvscope_cancel_to_release_seconds_count 1.0",
        'kvscope_kv_blocks{state="in_use"} 0.0',
        "kvscope_queue_depth 0.0",
        "kvscope_event_loop_lag_seconds_count",
        "kvscope_step_forward_seconds_count",
        "kvscope_worker_restarts_total 0.0",
        "kvscope_engine_model_bytes ",
        'kvscope_checkpoint_gap_seconds_bucket{le="0.002"}',
    ):
        assert needle in text, needle
    gaps = prometheus.histogram(text, "kvscope_checkpoint_gap_seconds")
    assert gaps[math.inf] > 0  # every step counted its gaps
    # One inter-token gap per token after each request's first, in cumulative buckets.
    itl = prometheus.histogram(text, "kvscope_inter_token_latency_seconds")
    assert itl[math.inf] == (5 - 1) + (gone_tokens - 1)
    counts = [itl[bound] for bound in sorted(itl)]
    assert counts == sorted(counts) and len(counts) == 16


def test_drain_then_shutdown(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path, drain_timeout=30.0) as live, live.client() as client:
        job = client.post(
            "/generate",
            json={"prompt": "finish me", "max_tokens": 1500, "temperature": 0, "ignore_eos": True},
        ).json()
        wait_tokens(client, job["id"])
        live.portal.call(live.server.request_shutdown)
        wait_for(
            lambda: client.get("/health").status_code == 503, what="/health to say shutting down"
        )
        refused = client.post("/generate", json={"prompt": "late"})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "unavailable_error"
        engine = live.server.engine
        assert engine is not None
        wait_for(
            lambda: live.portal.call(engine.get, job["id"]).status == "finished",
            what="the drained request",
        )
    record = live.audit_record(job["id"])
    assert record["finish_reason"] == "length" and record["generated_tokens"] == 1500


def test_json_answers_build_no_pydantic_adapter_per_response(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quart_schema would convert each dict a route returns through a new pydantic
    TypeAdapter (a sixth of the loop's time on a GET /stats); the routes return JSON
    builtins, which go out as they are."""
    built: list[object] = []
    build = pydantic.TypeAdapter.__init__

    def counted(self: pydantic.TypeAdapter[Any], *args: Any, **kwargs: Any) -> None:
        built.append(args[0] if args else kwargs.get("type"))
        build(self, *args, **kwargs)

    monkeypatch.setattr(pydantic.TypeAdapter, "__init__", counted)
    with live.client() as client:
        answers = [
            client.get("/stats"),
            client.get("/health"),
            client.get("/requests/unknown"),
            client.post("/generate", json={"prompt": "a", "max_tokens": 2}),
            client.post(
                "/v1/completions", json={"model": "tiny-random", "prompt": "a", "max_tokens": 2}
            ),
        ]
    assert [a.status_code for a in answers] == [200, 200, 404, 202, 200]
    assert all(a.headers["content-type"] == "application/json" for a in answers)
    assert built == []


def test_stats_and_health_answer_alike_with_and_without_a_body(live: Live) -> None:
    """A bodiless GET of /stats or /health is answered below Quart (`FastPath`), one
    with a body by the Quart route; both apply one rule, so the answers agree."""
    with live.client() as client:
        answers = {
            (path, content): client.request("GET", path, content=content)
            for path in ("/stats", "/health")
            for content in (None, b"{}")
        }
    for response in answers.values():
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
    assert answers["/health", None].json() == answers["/health", b"{}"].json()
    fast, routed = answers["/stats", None].json(), answers["/stats", b"{}"].json()
    assert set(fast) == set(routed) == set(Stats.model_json_schema()["properties"])
    assert fast["kv_blocks_total"] == routed["kv_blocks_total"] > 0
