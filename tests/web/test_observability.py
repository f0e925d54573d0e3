"""GET /stats, /metrics and /health; a drained shutdown (503 while draining)."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import attrs
import pydantic
import pytest

from kvscope.bench.core import prometheus
from kvscope.web.native.schemas import Stats
from kvscope.web.ops.stats_log import Totals, stats_line
from kvscope.web.ops.vllm_names import VLLM_NAMES

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


def test_metrics_also_go_out_under_vllms_names(live: Live) -> None:
    """Every figure vLLM exposes too is there under vLLM's name, labelled `model_name`
    and `engine` as vLLM labels it, with the value of kvscope's own (what a dashboard or
    gateway written for vLLM reads): request counts by vLLM's finish reasons, token
    counts and their per-request histograms, the phases of a request, the prefix
    cache's hits."""
    prompt = "the same prompt, long enough to fill a block or two of the prefix cache"
    with live.client() as client:
        for _ in range(2):  # the second finds the first's blocks in the prefix cache
            answer = client.post(
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            )
            assert answer.status_code == 200, answer.text
        gone = client.post("/generate", json={"prompt": "b", **LONG}).json()
        wait_tokens(client, gone["id"])
        assert client.get("/metrics").text.count("vllm:num_requests_running{") == 1
        running = _families(client.get("/metrics").text)["vllm:num_requests_running"]
        assert [s.value for s in running.samples] == [1.0]
        client.delete(f"/requests/{gone['id']}")
        wait_clean(live)
        text = client.get("/metrics").text
    families = _families(text)
    labels = {"model_name": "tiny-random", "engine": "0"}

    def value(name: str, **extra: str) -> float:
        (sample,) = [
            s
            for family in families.values()
            for s in family.samples
            if s.name == name and s.labels == labels | extra
        ]
        return sample.value

    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:request_success_total", finished_reason="abort") == 1
    assert value("vllm:num_requests_running") == 0 and value("vllm:num_requests_waiting") == 0
    assert value("vllm:kv_cache_usage_perc") == 0
    prompt_tokens = value("vllm:prompt_tokens_total")
    generated = value("vllm:generation_tokens_total")
    assert prompt_tokens > 2 and generated > 8
    assert value("vllm:prefix_cache_hits_total") >= 16  # at least one block, found again
    assert value("vllm:prefix_cache_queries_total") == prompt_tokens
    assert value("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value("vllm:request_generation_tokens_sum") == generated
    for phase in ("e2e_request_latency", "request_queue_time", "time_to_first_token"):
        assert value(f"vllm:{phase}_seconds_count") == 3, phase
    for phase in ("request_prefill_time", "request_decode_time", "request_inference_time"):
        assert value(f"vllm:{phase}_seconds_count") == 3, phase  # each had a token
    assert value("vllm:inter_token_latency_seconds_count") == generated - 3
    info = {"block_size": "16", "enable_prefix_caching": "True", "cache_dtype": "auto"}
    assert value("vllm:cache_config_info", **info) == 1
    # Each of vLLM's figures is a copy of kvscope's own, sample for sample.
    for ours, names in VLLM_NAMES.items():
        mine = [(s.name.removeprefix(ours), s.value) for s in families[ours].samples]
        for theirs in names:
            copied = [(s.name.removeprefix(theirs), s.value) for s in families[theirs].samples]
            # (per draft position: no sample while speculative decoding is off)
            assert mine == copied and (mine or ours.endswith("_per_pos")), (ours, theirs)
    assert value("vllm:gpu_cache_usage_perc") == 0  # the name older dashboards read


def _families(text: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}


def test_the_periodic_stats_line(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's periodic stats line: throughput, running and waiting, what ended (and was
    cancelled), the KV cache in use; written while there is work."""
    caplog.set_level(logging.INFO, logger="kvscope.stats")

    def line(pattern: str) -> str | None:
        for record in list(caplog.records):
            if record.name == "kvscope.stats" and re.search(pattern, record.getMessage()):
                return record.getMessage()
        return None

    with running_server(backend, tmp_path, stats_log_interval=0.05) as live:
        with live.client() as client:
            job = client.post("/generate", json={"prompt": "b", **LONG}).json()
            wait_tokens(client, job["id"])
            busy = r"generation throughput [1-9][\d.]* tokens/s, running 1, waiting 0"
            assert "KV cache 0.0%" not in wait_for(lambda: line(busy), what="a busy line")
            client.delete(f"/requests/{job['id']}")
            ended = r"running 0, waiting 0, ended 1 \(1 cancelled\), KV cache 0.0% in use"
            wait_for(lambda: line(ended), what="the line after the cancel")
        wait_clean(live)


def test_the_stats_line_gives_the_draft_acceptance_where_drafts_were_verified() -> None:
    stats = {"running": 1, "waiting": 0, "kv_blocks_in_use": 4, "kv_blocks_total": 16}
    before = Totals(0.0, 100, 0, 10, 0, 0, drafted=40, accepted=10)
    now = Totals(2.0, 100, 0, 50, 0, 0, drafted=80, accepted=40)
    line = stats_line(before, now, stats)
    assert line.endswith("draft acceptance 75.0% (30 of 40 tokens)"), line
    assert "draft" not in stats_line(before, attrs.evolve(now, drafted=40, accepted=10), stats)
