"""A replica's direct address: how the other replicas reach it once Serve no longer
routes calls to it.

When Serve begins stopping a replica (a rolling redeploy, a scale-down), its router
drops that replica from the candidates at once, while the replica still drains its live
requests for `--drain-timeout`. A `DELETE /requests/{id}` (or a look-up, or an events
stream) for one of them then reaches another replica, which could only answer 404: the
cancel was lost, and the request ran on until the drain cut it. So every replica also
serves its app on a listener of its own (`DirectListener`: the node's address, any
free port) and publishes that address in Ray's internal key-value store for as long as
it serves (`Directory`). A replica that receives a call for an id it does not own
forwards it to the owner's address (`AmongPeers.answer_here`). A replica that died
serves nothing there: the forward cannot connect, and the answer is the 404 that says
the owner is gone.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import attrs
from anyio.abc import TaskStatus

from kvscope.web.server import bind_socket, hypercorn_config, serve_app
from kvscope.web.settings import ServerSettings

from .messages import Message, Receive, Send

log = logging.getLogger("kvscope.replicas")

#: Where the addresses live in Ray's internal key-value store.
NAMESPACE = "kvscope"


def _key(replica: str) -> str:
    return f"direct/{replica}"


class Directory:
    """Each replica's direct address, in Ray's internal key-value store (the cluster's
    GCS: every replica on every node reads the same)."""

    async def publish(self, replica: str, address: str | None) -> bool:
        """Publish `replica`'s address; None withdraws it. False (logged) if the store
        could not be written: best effort, never an error of the call at hand."""
        from ray.experimental import internal_kv

        def put() -> None:
            if address is None:
                internal_kv._internal_kv_del(_key(replica), namespace=NAMESPACE)
            else:
                internal_kv._internal_kv_put(_key(replica), address, namespace=NAMESPACE)

        try:
            await anyio.to_thread.run_sync(put)
        except Exception:
            log.exception("could not write replica %s's direct address", replica)
            return False
        return True

    async def lookup(self, replica: str) -> str | None:
        """`replica`'s address, or None if it published none, withdrew it, or the store
        could not be read (logged)."""
        from ray.experimental import internal_kv

        def get() -> bytes | None:
            return internal_kv._internal_kv_get(_key(replica), namespace=NAMESPACE)

        try:
            value = await anyio.to_thread.run_sync(get)
        except Exception:
            log.exception("could not read replica %s's direct address", replica)
            return None
        return value.decode() if value else None


@attrs.frozen
class DirectHosts:
    """Where a replica's direct listener binds, and the host its address names."""

    bind: str
    advertise: str

    @classmethod
    def like_proxy(cls, proxy_host: str | None, node_address: str) -> DirectHosts:
        """Listen where Serve's proxy listens (`proxy_host`), so that a replica is no
        more widely reachable than the deployment: a wildcard binds the wildcard and
        names the node's address; a loopback proxy keeps the replicas on loopback
        (enough on one node: `kvscope serve --replicas`' own Ray); None (a cluster
        whose proxies kvscope did not start) binds the node's address."""
        if proxy_host is None:
            return cls(node_address, node_address)
        if proxy_host in ("", "0.0.0.0", "::"):
            return cls(proxy_host or "0.0.0.0", node_address)
        return cls(proxy_host, proxy_host)


class DirectListener:
    """Serves `app`'s HTTP calls on `hosts.bind`, any free port, on hypercorn, until
    `stop()`; its address names `hosts.advertise`. The lifespan is the replica's own
    (Serve runs it): this listener answers hypercorn's lifespan messages itself and
    hands the app only HTTP and WebSocket calls."""

    def __init__(self, app: Any, hosts: DirectHosts, settings: ServerSettings) -> None:
        self.app = app
        self.hosts = hosts
        self.settings = settings
        self._stop = anyio.Event()

    async def run(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve; `task_status.started(url)` once the socket listens."""
        sock = bind_socket(self.hosts.bind, 0)
        port = sock.getsockname()[1]
        config = hypercorn_config(sock, self.settings)
        config.accesslog = None
        host = self.hosts.advertise
        host = f"[{host}]" if ":" in host else host
        task_status.started(f"http://{host}:{port}")
        await serve_app(self._calls, config, "asyncio", self._stop.wait)

    def stop(self) -> None:
        self._stop.set()

    async def _calls(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
