"""Request ids that name their owning replica, and the routing key of an HTTP call.

A replica's engine generates ids `req-<replica>-<32 hex>`, `<replica>` being Ray
Serve's unique id of that replica (a new one after a restart, so an id of a replica
that died never reaches its successor). Everything here is plain Python (no Ray): the
request router runs it in Serve's proxy for every call, and the replica runs it to
tell its own ids from another's.

A response of the Responses API is named after its request (`resp_<replica>-<32 hex>`
for `req-<replica>-<32 hex>`), so it names its replica too: the one that stores it.

The routing key of an HTTP call, most specific first: the id in the path
(`/requests/{id}`, `/requests/{id}/events`, `/v1/responses/{id}` and its `/cancel`
and `/input_items`), then the `X-Kvscope-Replica` header, then the `replica`
query parameter. A call without one goes to the least loaded replica.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qs

from kvscope.web.openai.responses.ids import request_of_response

#: The header (or `?replica=` query parameter) that sends a call to one replica.
REPLICA_HEADER = "x-kvscope-replica"

_OWNED_ID = re.compile(r"req-([A-Za-z0-9]+)-[0-9a-f]{32}")
_ID_PATH = re.compile(r"/requests/([^/]+)(?:/events)?/?")
_RESPONSE_PATH = re.compile(r"/v1/responses/(resp_[^/]+?)(?:/cancel|/input_items)?/?")


def id_prefix(replica: str) -> str:
    """The `request_id_prefix` of the engine on `replica`."""
    return f"req-{replica}-"


def owner_of(request_id: str) -> str | None:
    """The replica that generated `request_id`, or None for an id that names none."""
    match = _OWNED_ID.fullmatch(request_id)
    return match.group(1) if match else None


def path_id(path: str) -> str | None:
    """The id an HTTP call's path names (a request's, or a response's), or None."""
    if match := _ID_PATH.fullmatch(path):
        return match.group(1)
    if match := _RESPONSE_PATH.fullmatch(path):
        return match.group(1)
    return None


def id_owner(any_id: str) -> str | None:
    """The replica a request's or a response's id names, or None."""
    return owner_of(request_of_response(any_id) if any_id.startswith("resp_") else any_id)


def routing_key(path: str, query: bytes, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The replica an HTTP call must reach (see the module docstring), or None."""
    named = path_id(path)
    if named is not None and (owner := id_owner(named)):
        return owner
    for name, value in headers:
        if name.lower() == REPLICA_HEADER.encode():
            return value.decode("latin-1").strip() or None
    values = parse_qs(query.decode("latin-1")).get("replica")
    return values[0] if values else None
