"""The serving lifespan: open the Engine, serve the app on hypercorn inside it, and
shut down in order.

`Server.run()` binds the listening socket (so port 0 works and the real port is known
before anything is served), opens the engine (the root task group: it outlives every
connection), builds the app, starts the event-loop lag monitor and, with
`handle_signals`, a SIGINT/SIGTERM watcher, then runs hypercorn until told to stop.

Shutdown (`request_shutdown()`, or the first signal) goes: mark the server shutting
down (`/health` answers 503, WebSockets close after their last `done`); stop accepting
requests (503) and let live ones finish for `drain_timeout` seconds; cancel what is
left with reason `shutdown`; wait until every request has ended and every stream has
sent its final event; then stop hypercorn, close the engine (which flushes the audit
log and checks that every block is back) and return. A second signal skips the waits.
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
from typing import Any

import anyio
from anyio.abc import TaskStatus
from hypercorn.config import Config as HypercornConfig

from kvscope import Engine
from kvscope.scheduling import RealtimeLoop, ask_for_short_slices

from .app import create_app
from .asgi import wire
from .context import ServerContext
from .ops.metrics import Metrics
from .ops.stats_log import log_stats
from .settings import ServerSettings

log = logging.getLogger("kvscope.web")


def bind_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0: any free port)."""
    family, type_, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class Server:
    def __init__(
        self,
        settings: ServerSettings,
        engine_kwargs: dict[str, Any],
        *,
        handle_signals: bool = False,
    ) -> None:
        self.settings = settings
        self.engine_kwargs = engine_kwargs
        self.handle_signals = handle_signals
        self.port: int | None = None
        self.engine: Engine | None = None
        self._stop_requested: anyio.Event | None = None
        self._stop_serving: anyio.Event | None = None

    @property
    def url(self) -> str:
        host = self.settings.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    async def run(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until shut down; `task_status.started(port)` once clients may connect."""
        self._stop_requested = anyio.Event()
        self._stop_serving = anyio.Event()
        sock = bind_socket(self.settings.host, self.settings.port)
        self.port = sock.getsockname()[1]
        config = hypercorn_config(sock, self.settings)
        async with Engine.open(**self.engine_kwargs) as engine:
            self.engine = engine
            metrics = Metrics()
            metrics.attach(engine)
            app = create_app(engine, self.settings, metrics)
            # Everything allocated so far (modules, the model) lives as long as the
            # server: keep it out of the cyclic collector's full passes, which grow
            # with the heap and stall the event loop (seen: 100-300 ms in a big heap).
            gc.freeze()
            realtime = self._ask_for_the_cpu()
            ctx: ServerContext = app.extensions["kvscope"]
            async with anyio.create_task_group() as tg:
                tg.start_soon(metrics.monitor_loop_lag, self.settings.lag_interval)
                if self.settings.stats_log_interval:
                    tg.start_soon(log_stats, engine, self.settings.stats_log_interval)
                if realtime is not None:
                    tg.start_soon(realtime.hold)
                tg.start_soon(self._shutdown_when_asked, ctx)
                if self.handle_signals:
                    await tg.start(self._watch_signals)
                log.info(
                    "kvscope listening on %s (model %s, device %s, backend %s, %d API key(s), "
                    "audit log %s, tool calls read as %s, reasoning parser %s)",
                    self.url,
                    engine.model_name,
                    engine.device,
                    self.settings.backend,
                    len(self.settings.api_keys),
                    engine.config.audit_log or "in memory",
                    ctx.tool_parser.name,
                    ctx.reasoning.name,
                )
                task_status.started(self.port)
                await serve_app(app, config, self.settings.backend, self._stop_serving.wait)
                tg.cancel_scope.cancel()
            log.info("kvscope stopped serving; closing the engine")

    def _ask_for_the_cpu(self) -> RealtimeLoop | None:
        """The loop's thread asks the scheduler for short slices and, where the OS allows
        it, a real-time priority (`kvscope.scheduling`), once the engine is up: the
        model's threads, started before, keep theirs. The `RealtimeLoop` to hold, if
        granted."""
        seconds, priority = self.settings.loop_slice, self.settings.loop_priority
        if seconds is not None:
            why_not = ask_for_short_slices(seconds)
            if why_not is None:
                log.info("event loop thread: %.1f ms scheduler slices", seconds * 1e3)
            else:
                log.info("event loop thread: the scheduler's default slices (%s)", why_not)
        if not priority:
            return None
        realtime = RealtimeLoop(priority, seconds)
        why_not = realtime.start()
        if why_not is not None:
            log.info("event loop thread: no real-time priority (%s)", why_not)
            return None
        log.info("event loop thread: real-time priority %d (SCHED_FIFO)", priority)
        return realtime

    def request_shutdown(self) -> None:
        """Begin the graceful shutdown (call from the server's event loop)."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def _shutdown_when_asked(self, ctx: ServerContext) -> None:
        assert self._stop_requested is not None and self._stop_serving is not None
        await self._stop_requested.wait()
        engine, settings = ctx.engine, self.settings
        ctx.shutting_down.set()
        log.info(
            "shutdown: %d live request(s), %d open stream(s); draining for %.1f s",
            engine.stats()["live_requests"],
            ctx.open_streams,
            settings.drain_timeout,
        )
        drained = await engine.drain(settings.drain_timeout)
        if not drained:
            live = engine.list_requests()
            for info in live:
                engine.cancel_nowait(info.id, reason="shutdown", by="server")
            log.info("shutdown: cancelled %d request(s) with reason shutdown", len(live))
        with anyio.move_on_after(settings.graceful_timeout):
            await engine.wait_idle()
            await ctx.wait_streams_closed()
        log.info(
            "shutdown: requests ended, %d stream(s) still open; stopping hypercorn",
            ctx.open_streams,
        )
        self._stop_serving.set()

    async def _watch_signals(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                if self._stop_requested is not None and not self._stop_requested.is_set():
                    log.info("received %s: shutting down", signal.Signals(signum).name)
                    self.request_shutdown()
                else:
                    log.warning("received %s again: stopping now", signal.Signals(signum).name)
                    assert self._stop_serving is not None
                    self._stop_serving.set()


def hypercorn_config(sock: socket.socket, settings: ServerSettings) -> HypercornConfig:
    """hypercorn's settings for serving the app on `sock` (which it takes over)."""
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]
    # Our own shutdown waits (up to graceful_timeout) until every stream has ended;
    # what hypercorn still holds then is idle keep-alive connections.
    config.graceful_timeout = 1.0
    config.websocket_max_message_size = settings.max_body_bytes
    config.errorlog = logging.getLogger("hypercorn.error")  # through our logging, once
    return config


async def serve_app(app: Any, config: HypercornConfig, backend: str, shutdown_trigger: Any) -> None:
    """Serve `app` on hypercorn until `shutdown_trigger()` returns; its fast-path
    requests are answered off the wire (`asgi/wire.py`)."""
    wire.take(app)
    if backend == "trio":
        from hypercorn.trio import serve

        await serve(app, config, shutdown_trigger=shutdown_trigger)
        return
    import asyncio

    from hypercorn.asyncio import serve as serve_asyncio

    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    await serve_asyncio(app, config, shutdown_trigger=shutdown_trigger)
    # hypercorn's shutdown (its asyncio.TaskGroup ending on ShutdownError, on Python
    # 3.11) can leave a cancellation request counted on this task that nobody made;
    # anyio's cancel scopes read that count, so leave it as it was.
    while task.cancelling() > cancelling:
        task.uncancel()
