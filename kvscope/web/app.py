"""The app factory: one Quart app (asyncio) or QuartTrio app (trio) over an open Engine.

`create_app(engine, settings)` wires the blueprints (native jobs, streaming,
WebSocket, OpenAI-compatible, the Responses API, embeddings and scores, SageMaker's
routes, observability, dashboard), the JSON
error handlers, API keys, quart-schema's OpenAPI document at `/openapi.json`, and the
body size cap; the `BodyGuard` in front of it refuses an unauthenticated or oversized
request from its headers alone, before any of its body is read (with `Cors` in front
where browser origins are allowed, answering their preflights), and `FastPath` behind
the guard answers `DELETE /requests/{id}`, `GET /stats` and `GET /health` without
Quart. A POST waits for its admission turn (`ServerContext.admission_turn`) before its
route runs. The app does not own the engine: `server.Server` opens the engine, then
serves this app on hypercorn inside it, so the engine outlives every connection.
"""

from __future__ import annotations

from quart import Quart, request
from quart_schema import QuartSchema
from quart_trio import QuartTrio

import kvscope
from kvscope import Engine

from . import auth, errors
from .asgi.cors import Cors
from .asgi.fast_path import FastPath
from .asgi.guard import BodyGuard
from .asgi.root_path import RootPath
from .context import ServerContext, server
from .native import jobs, streaming, websocket
from .openai import completions, embeddings, lora_admin, sagemaker, scores, tokens
from .openai.responses import routes as responses
from .ops import dashboard, observability
from .ops.metrics import Metrics
from .settings import ServerSettings


def create_app(
    engine: Engine, settings: ServerSettings | None = None, metrics: Metrics | None = None
) -> Quart:
    """The kvscope app over `engine`; call inside the event loop that runs the engine."""
    settings = settings or ServerSettings()
    app_class = QuartTrio if settings.backend == "trio" else Quart
    app = app_class("kvscope")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        RESPONSE_TIMEOUT=None,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    if metrics is None:
        metrics = Metrics()
        metrics.attach(engine)
    app.extensions["kvscope"] = ServerContext(engine, settings, metrics)
    QuartSchema(
        app,
        info={"title": "kvscope", "version": kvscope.__version__},
        swagger_ui_path=None,
        redoc_ui_path=None,
        scalar_ui_path=None,
        security_schemes={"bearer": {"type": "http", "scheme": "bearer"}}
        if settings.api_keys
        else None,
        security=[{"bearer": []}] if settings.api_keys else None,
    )
    # Keys in the order the routes put them (a logprobs' `top_logprobs` leads with the
    # sampled token, as vLLM's): the provider (quart_schema's) reads its own attribute, not the config.
    app.json.sort_keys = False  # type: ignore[attr-defined]
    # quart_schema converts every dict a route returns through a new pydantic
    # TypeAdapter, built per response (a sixth of the loop's time on a GET /stats);
    # kvscope's routes return JSON builtins, which need no conversion.
    app.make_response = getattr(app.make_response, "__wrapped__", app.make_response)  # type: ignore[method-assign]
    errors.register(app, retry_after=settings.retry_after)
    auth.register(app)  # the key first; then the body (the guard saw its size)
    app.before_request(_read_body_first)
    app.before_request(_admission_turn)
    context = app.extensions["kvscope"]
    app.asgi_app = BodyGuard(FastPath(app.asgi_app, context), settings)  # type: ignore[method-assign,assignment]
    if settings.cors.enabled:  # in front of the guard: a preflight carries no key
        app.asgi_app = Cors(app.asgi_app, settings.cors)  # type: ignore[method-assign,assignment]
    if settings.root_path:  # outermost: every layer below sees the path without it
        app.asgi_app = RootPath(app.asgi_app, settings.root_path)  # type: ignore[method-assign,assignment,arg-type]
    routes = (
        jobs,
        streaming,
        websocket,
        completions,
        responses,
        embeddings,
        scores,
        sagemaker,
        lora_admin,
        tokens,
        observability,
        dashboard,
    )
    for module in routes:
        app.register_blueprint(module.blueprint)
    return app


async def _read_body_first() -> None:
    """Read (and cache) the whole body before anything may answer without it.

    On quart-trio, answering a request (a 401, a 404) without reading its body leaves
    the rest of the body in the connection, and the next request on that keep-alive
    connection hangs. Bodies are capped by MAX_CONTENT_LENGTH (413), so this is cheap.
    """
    if request.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in request.headers:
        await request.get_data(cache=True)


async def _admission_turn() -> None:
    """A POST (a body to parse, a job to submit) waits for its turn, one to a pass of
    the event loop (`ServerContext.admission_turn`)."""
    if request.method == "POST":
        await server().admission_turn()
