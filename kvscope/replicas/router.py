"""The request router: every call that names a replica goes to that replica; a call
whose prompt has a prefix key goes to that prefix's replica where load allows.

Ray Serve runs one `OwnerRouter` wherever calls to the deployment start (its HTTP
proxy, and each replica's own handle). For a call that names a replica (an HTTP call
by the id in its path, the `X-Kvscope-Replica` header or `?replica=`; a handle call by
its `replica` keyword) it offers that replica alone, so `DELETE /requests/{id}`, a
look-up and an events stream reach the owner in one hop. `@<i>` names the i-th live
replica in a stable order (how `/stats` reaches each one). A named replica that is
not running gets an ordinary choice, and the replica that receives the call answers
for the dead one (404, see `asgi.py`).

A generation call carries the hash of its prompt's head (`X-Kvscope-Prefix`, added by
the proxy's `PrefixKeyMiddleware`, see `prefix.py`): it goes to the replica that
rendezvous hashing prefers for it, unless that replica has more ongoing calls than
the least loaded one by more than `imbalance`. A replica's load is the larger of its
ongoing calls (the queue lengths Serve's router keeps or probes, as Ray's own
`PrefixCacheAffinityRouter` checks load) and its engine's live requests (which it
reports every second through Serve's routing stats: native jobs run on after their
call answered). Every other call
goes to the less loaded of two random replicas (Serve's default, power of two).
"""

from __future__ import annotations

import pickle
import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .ids import routing_key
from .prefix import PREFIX_HEADER, preferred

#: How many more ongoing calls than the least loaded replica a prefix's replica may
#: have and still get the call.
IMBALANCE = 4


class OwnerRouter(RequestRouter):
    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs
        self, prefix_routing: bool = True, imbalance: int = IMBALANCE
    ) -> None:
        self.prefix_routing = prefix_routing
        self.imbalance = imbalance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        owner, prefix = _keys(pending_request) if pending_request is not None else (None, None)
        if owner is not None:
            chosen = pick(candidate_replicas, owner)
            if chosen is not None:
                return [[chosen]]
        if prefix is not None and self.prefix_routing and len(candidate_replicas) > 1:
            chosen = preferred(candidate_replicas, prefix)
            if await self._not_overloaded(chosen, candidate_replicas):
                return [[chosen]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    async def _not_overloaded(self, chosen: RunningReplica, replicas: list[RunningReplica]) -> bool:
        lengths: dict[Any, int] = {}
        unknown = []
        for replica in replicas:
            length = (
                self._replica_queue_len_cache.get(replica.replica_id)
                if self._use_replica_queue_len_cache
                else None
            )
            if length is None:
                unknown.append(replica)
            else:
                lengths[replica.replica_id] = length
        if unknown:
            for replica, length in await self._probe_queue_lens(unknown, 0):
                if length is not None:
                    lengths[replica.replica_id] = length
        loads = {
            r.replica_id: max(lengths[r.replica_id], _live(r))
            for r in replicas
            if r.replica_id in lengths
        }
        mine = loads.get(chosen.replica_id)
        return mine is not None and mine - min(loads.values()) <= self.imbalance


def _live(replica: RunningReplica) -> int:
    """The live requests of a replica's engine, as it last reported them: a native job
    (`POST /generate` answers 202 at once) is no ongoing call, but it is load."""
    live = (replica.routing_stats or {}).get("live_requests")
    return live if isinstance(live, int) else 0


def pick(replicas: list[Any], key: str) -> Any | None:
    """The replica `key` names among `replicas` (by unique id, or `@<i>`), or None."""
    if key.startswith("@") and key[1:].isdigit():
        ordered = sorted(replicas, key=lambda r: r.replica_id.unique_id)
        index = int(key[1:])
        return ordered[index] if index < len(ordered) else None
    return next((r for r in replicas if r.replica_id.unique_id == key), None)


def _keys(pending: PendingRequest) -> tuple[str | None, str | None]:
    """The replica a call names, and its prefix key."""
    replica = pending.kwargs.get("replica")
    if isinstance(replica, str):
        return replica, None
    if pending.args and isinstance(pending.args[0], bytes):
        # A call from Serve's HTTP proxy: a pickled StreamingHTTPRequest that carries
        # the ASGI scope (the body follows separately, so the router never sees it).
        try:
            scope = pickle.loads(pending.args[0]).asgi_scope
            headers = scope["headers"]
            owner = routing_key(scope["path"], scope.get("query_string", b""), headers)
        except Exception:  # another kind of call: route it like any other
            return None, None
        prefix = next((v.decode("latin-1") for k, v in headers if k == PREFIX_HEADER), None)
        return owner, prefix
    return None, None
