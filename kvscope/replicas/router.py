"""The request router: every call that names a replica goes to that replica.

Ray Serve runs one `OwnerRouter` wherever calls to the deployment start (its HTTP
proxy, and each replica's own handle). For a call that names a replica (an HTTP call
by the id in its path, the `X-Kvscope-Replica` header or `?replica=`; a handle call by
its `replica` keyword) it offers that replica alone, so `DELETE /requests/{id}`, a
look-up and an events stream reach the owner in one hop. `@<i>` names the i-th live
replica in a stable order (how `/stats` reaches each one). Every other call goes to
the less loaded of two random replicas (Serve's default policy, power of two choices).
A named replica that is not running gets an ordinary choice, and the replica that
receives the call answers for the dead one (404, see `asgi.py`).
"""

from __future__ import annotations

import pickle
import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .ids import routing_key


class OwnerRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = _key(pending_request) if pending_request is not None else None
        if key is not None:
            chosen = pick(candidate_replicas, key)
            if chosen is not None:
                return [[chosen]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


def pick(replicas: list[Any], key: str) -> Any | None:
    """The replica `key` names among `replicas` (by unique id, or `@<i>`), or None."""
    if key.startswith("@") and key[1:].isdigit():
        ordered = sorted(replicas, key=lambda r: r.replica_id.unique_id)
        index = int(key[1:])
        return ordered[index] if index < len(ordered) else None
    return next((r for r in replicas if r.replica_id.unique_id == key), None)


def _key(pending: PendingRequest) -> str | None:
    replica = pending.kwargs.get("replica")
    if isinstance(replica, str):
        return replica
    if pending.args and isinstance(pending.args[0], bytes):
        # A call from Serve's HTTP proxy: a pickled StreamingHTTPRequest that carries
        # the ASGI scope (the body follows separately, so the router never sees it).
        try:
            scope = pickle.loads(pending.args[0]).asgi_scope
            return routing_key(scope["path"], scope.get("query_string", b""), scope["headers"])
        except Exception:  # another kind of call: route it like any other
            return None
    return None
