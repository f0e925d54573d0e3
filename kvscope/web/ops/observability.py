"""Observability: `GET /stats` (JSON), `GET /metrics` (Prometheus text), `GET /health`,
`GET /ready`.

`/health` needs no key: 200 `{"status": "ok", "ready": true}` while the server takes
requests, 503 `{"status": "shutting_down", "ready": false}` once shutdown began (alive,
not ready), so a load balancer stops sending work before the streams are cut.

`/ready` (no key either) answers 200 once the server serves at full speed, 503 while it
still warms up (`actors/readiness.py`: the kernel build, the model worker, the warm-up)
or shuts down; its body, like `/stats`, carries `readiness` (`warming` or `ready`) and
`warming` (what it still waits for). A script polls it before it measures.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from quart import Blueprint, Response
from quart_schema import document_response

from ..context import ServerContext, server
from ..native.schemas import Health, Readiness, Stats

blueprint = Blueprint("observability", __name__)


@blueprint.get("/stats")
@document_response(Stats, 200)
async def stats() -> Any:
    """KV blocks (total, free, in use, cached), running, waiting, live, and counts of
    finished, cancelled and failed requests."""
    status, body = stats_answer(server())
    return body, status


def stats_answer(ctx: ServerContext) -> tuple[int, dict[str, Any]]:
    """`GET /stats`: the status and the JSON body (this route and `asgi.fast_path.FastPath`
    both answer with it)."""
    stats = ctx.engine.stats()
    return 200, {**stats, **ctx.metrics.snapshot(), **_readiness(ctx, stats)}


@blueprint.get("/metrics")
async def metrics() -> Response:
    """Prometheus exposition of the server's metrics."""
    return Response(server().metrics.render(), content_type=CONTENT_TYPE_LATEST)


@blueprint.get("/health")
@document_response(Health, 200)
@document_response(Health, 503)
async def health() -> Any:
    """Liveness and readiness."""
    status, body = health_answer(server())
    return body, status


def health_answer(ctx: ServerContext) -> tuple[int, dict[str, Any]]:
    """`GET /health`: the status and the JSON body (this route and `asgi.fast_path.FastPath`
    both answer with it)."""
    ready = ctx.engine.accepting and not ctx.shutting_down.is_set()
    body = {
        "status": "ok" if ready else "shutting_down",
        "ready": ready,
        "model": ctx.engine.model_name,
    }
    return (200 if ready else 503), body


@blueprint.get("/ready")
@document_response(Readiness, 200)
@document_response(Readiness, 503)
async def ready() -> Any:
    """Whether the server serves at full speed (200), or still warms up (503, with what
    it waits for); 503 too once shutdown began."""
    ctx = server()
    body = _readiness(ctx, ctx.engine.stats())
    accepting = ctx.engine.accepting and not ctx.shutting_down.is_set()
    return body, (200 if accepting and body["readiness"] == "ready" else 503)


def _readiness(ctx: ServerContext, stats: dict[str, int]) -> dict[str, Any]:
    engine = ctx.engine
    warming = engine.waiting_for(stats)
    return {"readiness": "warming" if warming else "ready", "warming": list(warming)}
