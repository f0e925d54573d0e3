"""Request ids that name their owning replica, and the routing key of an HTTP call.

A replica's engine generates ids `req-<replica>-<32 hex>`, `<replica>` being Ray
Serve's unique id of that replica (a new one after a restart, so an id of a replica
that died never reaches its successor). Everything here is plain Python (no Ray): the
request router runs it in Serve's proxy for every call, and the replica runs it to
tell its own ids from another's.

The routing key of an HTTP call, most specific first: the id in the path
(`/requests/{id}`, `/requests/{id}/events`), then the `X-Kvscope-Replica` header, then
the `replica` query parameter. A call without one goes to the least loaded replica.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qs

#: The header (or `?replica=` query parameter) that sends a call to one replica.
REPLICA_HEADER = "x-kvscope-replica"

_OWNED_ID = re.compile(r"req-([A-Za-z0-9]+)-[0-9a-f]{32}")
_ID_PATH = re.compile(r"/requests/([^/]+)(?:/events)?/?")


def id_prefix(replica: str) -> str:
    """The `request_id_prefix` of the engine on `replica`."""
    return f"req-{replica}-"


def owner_of(request_id: str) -> str | None:
    """The replica that generated `request_id`, or None for an id that names none."""
    match = _OWNED_ID.fullmatch(request_id)
    return match.group(1) if match else None


def routing_key(path: str, query: bytes, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The replica an HTTP call must reach (see the module docstring), or None."""
    match = _ID_PATH.fullmatch(path)
    if match and (owner := owner_of(match.group(1))):
        return owner
    for name, value in headers:
        if name.lower() == REPLICA_HEADER.encode():
            return value.decode("latin-1").strip() or None
    values = parse_qs(query.decode("latin-1")).get("replica")
    return values[0] if values else None
