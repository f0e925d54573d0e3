"""One replica's ASGI app: the engine's lifespan, and the kvscope Quart app inside it.

Ray Serve runs an ingress deployment's ASGI lifespan in one task for the replica's
whole life (uvicorn's `LifespanOn`): `lifespan.startup` when the replica starts,
`lifespan.shutdown` when Serve stops it. `ReplicaApp` opens the `Engine` in that task
(`async with Engine.open(...)`, so the engine's root task group is as structured as in
`kvscope serve`), builds the same Quart app as the single server (`create_app`), and
hands every HTTP and WebSocket call to it. On shutdown it drains like the single
server on SIGTERM: refuse new work, let live requests run for `drain_timeout`, cancel
the rest with reason `shutdown`, wait until every stream sent its last event, close.

What it adds in front of the Quart app, knowing it is one of several replicas (the
calls that concern other replicas are `among_peers.py`'s):

* an id in the path (`/requests/{id}`) that another replica generated reaches this one
  only when Serve no longer routes to its owner (the router sends every other one
  there): the owner is draining, and the call is forwarded to the owner's direct
  address (`direct`), or the owner is gone, and the answer is a 404 saying so, instead
  of the plain "no request";
* `/stats`, `/metrics` and `GET /requests` gather every replica's own (`peers`),
  labelled by replica; `?replica=<name>` (or the `X-Kvscope-Replica` header) reads
  one replica;
* a body that names a `parent` on another replica is forwarded to that replica
  (`peers.forward`; on a WebSocket, `wschildren`), so children start inside their
  parent's scope there; so is a response whose `previous_response_id` another
  replica stores (responses are stored where they ran);
* the kvscope id is repeated in `X-Kvscope-Request-Id` (Ray Serve's proxy appends
  its own value to `X-Request-Id`, which kvscope's proxy middleware then drops: see
  `proxy`);
* Serve's cancellation of a call becomes the disconnect message Quart expects
  (`_call_app`). This module is asyncio-only, as Ray Serve is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import anyio
from anyio.abc import TaskGroup

from kvscope import Engine
from kvscope.web.app import create_app
from kvscope.web.context import ServerContext, call_deadline
from kvscope.web.ops.metrics import Metrics
from kvscope.web.ops.stats_log import log_stats
from kvscope.web.settings import ServerSettings

from .among_peers import AmongPeers, Peers, tagged
from .direct import DirectHosts, DirectListener
from .ids import REPLICA_HEADER
from .messages import (
    Message,
    Receive,
    Send,
    call_timeout,
    error_body,
    is_forwarded,
    json_answer,
)
from .stopping import serve_stopping
from .wschildren import ChildForwarder

log = logging.getLogger("kvscope.replicas")

#: How long a call cut by Serve may take to close (its final cleanup is synchronous).
DISCONNECT_GRACE = 5.0
#: How early, at most, a cut call counts as timed out (see `__call__`).
TIMEOUT_SLACK = 0.25
#: How often a replica looks whether Serve began stopping it (a flag read).
STOPPING_POLL = 0.2


class ReplicaApp:
    def __init__(
        self,
        replica: str,
        engine_kwargs: dict[str, Any],
        settings: ServerSettings,
        peers: Peers,
        request_timeout: float | None = None,
        direct_hosts: DirectHosts | None = None,
    ) -> None:
        self.replica = replica
        #: Where this replica listens for calls that Serve no longer routes to it;
        #: None: no such listener.
        self.direct_hosts = direct_hosts
        #: Serve's end-to-end timeout of an HTTP call (its `request_timeout_s`).
        self.request_timeout = request_timeout
        self.engine_kwargs = engine_kwargs
        self.settings = settings
        self.peers = peers
        self.ctx: ServerContext | None = None
        self._draining = anyio.Lock()
        self._app: Any = None
        self._among_peers = AmongPeers(replica, peers, lambda: self._app, self._call_app)

    def load(self) -> dict[str, int]:
        """This replica's load, for the router: its engine's live requests."""
        if self.ctx is None:
            return {}
        return {"live_requests": self.ctx.engine.stats()["live_requests"]}

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self._app is None:  # a call after the lifespan ended (Serve routes none before)
            await json_answer(
                send, 503, error_body("the replica is not serving", "unavailable_error")
            )
            return
        timeout = call_timeout(scope.get("headers", ()), self.request_timeout)
        if timeout is not None:
            # Serve's clock started at its proxy, a little before this one: a call cut
            # within the slack of its deadline was cut by the timeout.
            slack = min(TIMEOUT_SLACK, timeout / 10)
            call_deadline.set(time.monotonic() + timeout - slack)
        if scope["type"] == "http":
            if await self._among_peers.answer_here(scope, receive, send):
                return
            send = tagged(send, self.replica)
        elif not is_forwarded(scope):
            # A body naming a parent on another replica runs there (see wschildren).
            children = ChildForwarder(self.replica, self.peers, scope, receive, send)
            try:
                await self._call_app(scope, children.receive, send)
            finally:
                children.close()
            return
        await self._call_app(scope, receive, send)

    async def _call_app(self, scope: Message, receive: Receive, send: Send) -> None:
        """Run the Quart app on one call, turning Serve's cancellation into a disconnect.

        Serve cancels the replica's task when the client went away or its timeout
        passed. Quart's ASGI connection, cancelled while it waits for its handler,
        leaves that handler running (it reacts to a `disconnect` message, which is
        what hypercorn sends, not to being cancelled): a stream would run on for
        nobody. So the app runs in a task of its own, shielded; on cancellation its
        `receive` answers the disconnect, Quart ends the handler (the stream body's
        `finally` cancels the request), and the app is waited for, briefly.
        """
        cut = asyncio.Event()
        disconnect: Message = {
            "type": "websocket.disconnect" if scope["type"] == "websocket" else "http.disconnect",
            "code": 1006,
        }

        async def receive_or_cut() -> Message:
            if cut.is_set():
                return disconnect
            message = asyncio.ensure_future(receive())
            waiter = asyncio.ensure_future(cut.wait())
            await asyncio.wait([message, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if message.done():
                return message.result()
            message.cancel()
            return disconnect

        call = asyncio.ensure_future(self._app(scope, receive_or_cut, send))
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            cut.set()
            try:
                await asyncio.wait_for(asyncio.shield(call), DISCONNECT_GRACE)
            except (TimeoutError, asyncio.CancelledError):
                call.cancel()
            except Exception:  # the app's own failure, now nobody's to answer
                log.exception("a call cut by Serve failed while closing")
            raise

    # -- the lifespan ------------------------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup", message
        started = False
        try:
            async with Engine.open(**self.engine_kwargs) as engine:
                metrics = Metrics()
                metrics.attach(engine)
                app = create_app(engine, self.settings, metrics)
                await app.startup()
                self.ctx = app.extensions["kvscope"]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(metrics.monitor_loop_lag, self.settings.lag_interval)
                    if self.settings.stats_log_interval:
                        tg.start_soon(log_stats, engine, self.settings.stats_log_interval)
                    tg.start_soon(self._drain_when_stopping)
                    self._app = app
                    direct = await self._open_direct(tg)
                    log.info("replica %s serving (model %s)", self.replica, engine.model_name)
                    await send({"type": "lifespan.startup.complete"})
                    started = True
                    message = await receive()
                    assert message["type"] == "lifespan.shutdown", message
                    await self._drain()
                    if direct is not None:
                        await self.peers.publish(self.replica, None)
                        direct.stop()
                    tg.cancel_scope.cancel()
                await app.shutdown()
        except BaseException as exc:
            if not started:
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
            raise
        finally:
            self._app = None
        await send({"type": "lifespan.shutdown.complete"})

    async def _open_direct(self, tg: TaskGroup) -> DirectListener | None:
        """Serve this app on the replica's direct address too, and publish it."""
        if self.direct_hosts is None:
            return None
        direct = DirectListener(self, self.direct_hosts, self.settings)
        address = await tg.start(direct.run)
        if not await self.peers.publish(self.replica, address):
            # Serve all the same; only calls that reach it while it drains miss it.
            log.warning(
                "replica %s: while it drains, calls for its requests will answer 404",
                self.replica,
            )
        log.info("replica %s: direct address %s", self.replica, address)
        return direct

    async def _drain_when_stopping(self) -> None:
        """Drain as soon as Serve begins stopping this replica, not after its own wait
        for the ongoing calls (which a stream is until its end): see `stopping`."""
        stopping = serve_stopping()
        if stopping is None:
            return
        while not stopping():
            await anyio.sleep(STOPPING_POLL)
        log.info("replica %s: Serve is stopping it, draining", self.replica)
        await self._drain()

    async def _drain(self) -> None:
        """The single server's SIGTERM: drain, cancel the rest, wait for last events.
        Run when Serve begins stopping the replica and again at the lifespan's end
        (then at once: nothing is left)."""
        async with self._draining:
            await self._drain_once()

    async def _drain_once(self) -> None:
        assert self.ctx is not None
        ctx, engine, settings = self.ctx, self.ctx.engine, self.settings
        ctx.shutting_down.set()
        if not await engine.drain(settings.drain_timeout):
            for info in engine.list_requests():
                engine.cancel_nowait(info.id, reason="shutdown", by="server")
        with anyio.move_on_after(settings.graceful_timeout):
            await engine.wait_idle()
            await ctx.wait_streams_closed()
        log.info("replica %s drained: %s", self.replica, engine.stats())


__all__ = ["REPLICA_HEADER", "Peers", "ReplicaApp"]
