"""The Ray Serve deployment: N replicas, each one `Engine` behind Serve's HTTP proxy.

`build_app(...)` returns the Serve application (`serve.run(build_app(...))`);
`app_builder(args)` is the same for `serve run kvscope.replicas:app_builder key=value`
and Serve config files. Each replica is `KvscopeReplica`, an ingress deployment whose
ASGI app is a `ReplicaApp` built when the replica starts (the engine's generated ids
carry the replica's Serve unique id), routed by `OwnerRouter`. Replicas reach each
other through Serve's proxy (`ProxyPeers`): a call that names a replica goes to it by
the router, so gathering `/stats` or forwarding a child's body to its parent's
replica is one more hop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack
from typing import Any

import anyio
import httpx
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvscope.web.settings import ServerSettings

from .asgi import ReplicaApp
from .direct import DirectHosts, Directory
from .ids import REPLICA_HEADER, id_prefix
from .messages import FORWARDED_HEADER, Message
from .proxy import one_request_id
from .router import OwnerRouter

log = logging.getLogger("kvscope.replicas")

DEPLOYMENT = "kvscope"
#: How long gathering `/stats` or `/metrics` waits for one replica.
PEER_TIMEOUT = 5.0
#: How often Serve collects each replica's load for the router (`record_routing_stats`).
ROUTING_STATS_PERIOD = 1.0
#: Serve's kill deadline of a stopping replica, past its drain (closing the engine).
SHUTDOWN_SLACK = 5.0


class ProxyPeers:
    """The deployment's replicas, reached through Serve's HTTP proxy with the router's
    `replica` key: `@<i>` for the i-th (to gather), a replica's name (to forward).

    Through the proxy, not a DeploymentHandle: a handle call made from inside a
    replica of this deployment did not complete here (Ray 2.60, 2 CPUs), and over
    HTTP a forwarded stream keeps the proxy's own disconnect handling.
    """

    def __init__(self, proxy_url: str, world_size: int) -> None:
        self._url = proxy_url
        self._world_size = world_size
        self._directory = Directory()

    def _client(self, url: str | None = None) -> httpx.AsyncClient:
        # A client per call: a shared pool left a connection slot stuck after a
        # cancelled call (httpx.PoolTimeout seen), and a local connect costs ~1 ms.
        return httpx.AsyncClient(
            base_url=url or self._url, timeout=httpx.Timeout(PEER_TIMEOUT, read=None)
        )

    async def reach(self, replica: str) -> str | None:
        return await self._directory.lookup(replica)

    async def publish(self, replica: str, address: str | None) -> bool:
        return await self._directory.publish(replica, address)

    async def each(self, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, bytes]:
        answers: dict[str, bytes] = {}

        async def ask(client: httpx.AsyncClient, index: int) -> None:
            with anyio.move_on_after(PEER_TIMEOUT):
                try:
                    response = await client.get(
                        path, params={"replica": f"@{index}"}, headers=headers
                    )
                except httpx.HTTPError as exc:  # a replica dying meanwhile: leave it out
                    log.warning("replica @%d did not answer %s: %r", index, path, exc)
                    return
                replica = response.headers.get(REPLICA_HEADER)
                if response.status_code == 200 and replica:
                    answers[replica] = response.content

        async with self._client() as client, anyio.create_task_group() as tg:
            for index in range(self._world_size):
                tg.start_soon(ask, client, index)
        return answers

    async def forward(
        self, replica: str, scope: Message, body: bytes, via: str | None = None
    ) -> AsyncGenerator[Message, None]:
        # The caller's own routing header would send the call back here.
        drop = _HOP_BY_HOP | {REPLICA_HEADER.encode()}
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
        headers += [(REPLICA_HEADER.encode(), replica.encode()), (FORWARDED_HEADER, b"1")]
        path = scope["path"]
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        async with self._client(via) as client, AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(
                    client.stream(scope["method"], path, headers=headers, content=body)
                )
            except httpx.ConnectError as exc:
                raise ConnectionError(f"replica {replica} at {via or self._url}: {exc}") from exc
            kept = one_request_id(
                (name, value)
                for name, value in response.headers.raw
                if name.lower() not in _HOP_BY_HOP
            )
            yield {"type": "http.response.start", "status": response.status_code, "headers": kept}
            async for chunk in response.aiter_raw():
                yield {"type": "http.response.body", "body": chunk, "more_body": True}
            yield {"type": "http.response.body", "body": b"", "more_body": False}

    def connect(self, replica: str, scope: Message) -> Any:
        from websockets.asyncio.client import connect

        url = self._url.replace("http", "ws", 1) + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        # The caller's key (the owner sees the same owner); the router's header wins
        # over a `?replica=` in the query.
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in scope.get("headers", ())
            if name.lower() == b"authorization"
        ]
        headers += [(REPLICA_HEADER, replica), (FORWARDED_HEADER.decode(), "1")]
        return connect(url, additional_headers=headers, open_timeout=PEER_TIMEOUT)


_HOP_BY_HOP = {
    b"host",
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"content-length",
    b"date",
    b"server",
}


@serve.ingress()
class KvscopeReplica:
    """One replica: its engine and its app live as long as the replica (the ASGI
    lifespan that Serve runs); see `ReplicaApp`."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        engine_kwargs: dict[str, Any],
        settings: dict[str, Any],
        proxy_url: str,
        request_timeout_s: float | None,
        direct_host: str | None = None,
    ) -> None:
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        peers = ProxyPeers(proxy_url, context.world_size)
        engine_kwargs = {**engine_kwargs, "request_id_prefix": id_prefix(self.replica)}
        self.asgi = ReplicaApp(
            self.replica,
            engine_kwargs,
            ServerSettings(**settings),
            peers,
            request_timeout_s,
            DirectHosts.like_proxy(direct_host, ray.util.get_node_ip_address()),
        )

    def __serve_build_asgi_app__(self) -> ReplicaApp:
        return self.asgi

    async def record_routing_stats(self) -> dict[str, int]:
        """Serve's routing stats: what the router weighs as this replica's load."""
        return self.asgi.load()


def build_app(
    engine_kwargs: dict[str, Any] | None = None,
    *,
    replicas: int = 2,
    settings: dict[str, Any] | None = None,
    cpus_per_replica: float = 1.0,
    graceful_shutdown_timeout_s: float | None = None,
    proxy_url: str = "http://127.0.0.1:8000",
    request_timeout_s: float | None = None,
    prefix_routing: bool = True,
    direct_host: str | None = None,
) -> Any:
    """The Serve application: `replicas` copies of `KvscopeReplica` routed by
    `OwnerRouter`. `engine_kwargs` are `Engine.open`'s, `settings` `ServerSettings`'s;
    `proxy_url` is where a replica reaches Serve's HTTP proxy on its own node;
    `request_timeout_s` must be the proxy's own (`http_options`), so that a call it cuts
    at that deadline is cancelled with reason `timeout`. `prefix_routing` sends prompts
    that share a prefix to one replica where load allows (see `prefix`). `direct_host`
    is the host Serve's proxy listens on, if kvscope started it: each replica's direct
    listener binds alike (see `direct.DirectHosts`). A stopping replica drains like
    the single server on SIGTERM (see `stopping`); `graceful_shutdown_timeout_s`, after
    which Serve kills it, defaults to that drain's length and some slack."""
    settings = dict(settings or {})
    checked = ServerSettings(**settings)  # validate here, not in every replica
    if graceful_shutdown_timeout_s is None:
        graceful_shutdown_timeout_s = (
            checked.drain_timeout + checked.graceful_timeout + SHUTDOWN_SLACK
        )
    deployment = serve.deployment(
        name=DEPLOYMENT,
        num_replicas=replicas,
        # Streams are long and cheap to hold: only the engine's own queue limits them.
        max_ongoing_requests=10_000,
        max_queued_requests=-1,
        ray_actor_options={"num_cpus": cpus_per_replica},
        request_router_config=RequestRouterConfig(
            request_router_class=OwnerRouter,  # type: ignore[arg-type]
            request_router_kwargs={"prefix_routing": prefix_routing},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD,  # type: ignore[arg-type]
        ),
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
        # How often Serve looks whether a stopping replica's calls ended: a drained
        # replica goes soon after its last stream's last event.
        graceful_shutdown_wait_loop_s=0.5,
        # A replica dying fails its health check; Serve starts a new one.
        health_check_period_s=2.0,
        health_check_timeout_s=10.0,
    )(KvscopeReplica)
    return deployment.bind(
        dict(engine_kwargs or {}), settings, proxy_url, request_timeout_s, direct_host
    )


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run kvscope.replicas:app_builder replicas=2 model=bundled ...`: every
    other key is an `Engine.open` setting (numbers and booleans parsed)."""
    args = dict(args)
    replicas = int(args.pop("replicas", 2))
    cpus = float(args.pop("cpus_per_replica", 1.0))
    proxy_url = args.pop("proxy_url", "http://127.0.0.1:8000")
    prefix_routing = bool(_value(args.pop("prefix_routing", "true")))
    timeout = args.pop("request_timeout_s", None)
    engine_kwargs = {key: _value(value) for key, value in args.items()}
    return build_app(
        engine_kwargs,
        replicas=replicas,
        cpus_per_replica=cpus,
        proxy_url=proxy_url,
        prefix_routing=prefix_routing,
        request_timeout_s=float(timeout) if timeout is not None else None,
    )


def _value(text: str) -> Any:
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)
