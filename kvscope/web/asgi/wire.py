"""The fast path's requests taken off the wire: a bodiless `DELETE /requests/{id}`,
`GET /stats` or `GET /health` that arrives alone on an idle HTTP/1.1 connection is
answered from its bytes, before hypercorn parses it.

`FastPath` spares these requests Quart; this spares them hypercorn's own machinery,
which was most of what was left. Measured on the 2-core AVX2 machine, idle, one raw
HTTP/1.1 client, p50 round trips: a bare asyncio protocol 0.10-0.13 ms, a bare ASGI app
on hypercorn 0.54 ms, `DELETE /requests/unknown` on `kvscope serve` 0.77-0.84 ms.
hypercorn parses the head with h11, builds a stream, runs the app in a task of its own
that sends through queues, and writes the answer's head and body in two writes: about
nine passes of the event loop a request, each of which, under load, waits behind
whatever else is ready (the 32 streams' writes).

`install()` wraps hypercorn's HTTP/1.1 protocol (`H11Protocol.handle`) once per
process; the wrapper acts only on connections that serve an app given to `take(app)`
(`server.serve_app` gives its app; another app served by hypercorn in the same process
is left alone) and only where all of these hold, else hypercorn has the bytes as
before:

* the connection is between requests: h11 idle on both sides, no stream, nothing
  buffered, the server not shutting down, no server names configured;
* the bytes are exactly one request head (`parse_head`): `GET` or `DELETE`, an ASCII
  target, `HTTP/1.1`, plain header lines with one `Host`, no `Upgrade`, `Expect` or
  `Transfer-Encoding`, no `Connection` but `keep-alive` and no `Content-Length` but 0
  (a partial packet, pipelined requests, HTTP/1.0 and bodies all go to hypercorn);
* `fast_path.answered_here` takes the request.

The request then goes through the app's whole ASGI stack (`BodyGuard`, `FastPath`:
the same checks and the same answer), with the scope hypercorn would build; the answer
is written at once, in one write, with hypercorn's `date` and `server` headers. The
rest is done as hypercorn does it: the idle timer stopped and restarted
(`Updated`), the request counted for `keep_alive_max_requests` and `max_requests`, the
access log, and the connection closed after an answer that says `connection: close`
(a refusal) or the last request hypercorn allows on it. Where hypercorn's protocol is
not the one this was written against (`WRITTEN_AGAINST`), hypercorn keeps the
connection: `install` logs and leaves hypercorn alone where its version is another or it
cannot import the protocol, and a connection whose protocol lacks a field this reads
(`PROTOCOL_FIELDS`) is left to it. tests/web/test_wire.py pins the installed version to
`WRITTEN_AGAINST`, so a new hypercorn fails there until the patch is read against it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from importlib import metadata
from typing import Any
from urllib.parse import unquote

import h11

from .fast_path import answered_here

log = logging.getLogger("kvscope.web")

#: One request head: request line, header lines, the blank line, nothing after. A
#: header's value is one character class up to its line's end, so a long line that
#: fails to match fails in linear time (no overlapping repeats to backtrack through).
HEAD = re.compile(
    rb"(GET|DELETE) (/[!-~]*) HTTP/1\.1\r\n((?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t -~]*\r\n)*)\r\n"
)
#: Headers that give a request a body or another protocol: hypercorn handles those (and
#: a `Connection` header other than `keep-alive`, HTTP/1.1's default that httpx, the
#: openai package and requests send with every request).
DECLINED_HEADERS = frozenset({b"upgrade", b"expect", b"transfer-encoding"})
#: What the wrapper reads of hypercorn's `H11Protocol` (checked at each use: a
#: connection of a protocol without one of them goes to hypercorn).
PROTOCOL_FIELDS = (
    "app",
    "config",
    "connection",
    "context",
    "keep_alive_requests",
    "stream",
    "send",
    "ssl",
)

#: hypercorn's minor releases whose `H11Protocol` this was written and tested against.
WRITTEN_AGAINST = ("0.17", "0.18")

_taken: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False
_install_lock = threading.Lock()  # servers in two threads (tests, embedding) start at once


def take(app: Any) -> None:
    """Answer `app`'s fast-path requests off the wire (installs the wrapper)."""
    if install():
        _taken.add(app)


def install() -> bool:
    """Wrap hypercorn's HTTP/1.1 protocol once; False where it is not the expected one."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        version = metadata.version("hypercorn")
        if not written_against(version):
            log.warning(
                "fast path off the wire not installed: hypercorn %s is not one of %s",
                version,
                ", ".join(WRITTEN_AGAINST),
            )
            return False
        try:
            from hypercorn.events import Closed, RawData, Updated
            from hypercorn.protocol.h11 import H11Protocol
        except ImportError as exc:
            log.warning("fast path off the wire not installed: %s", exc)
            return False
        _wrap(H11Protocol, RawData, Updated, Closed)
        _installed = True
        return True


def written_against(version: str) -> bool:
    """Whether hypercorn `version` ("0.18.0") is a release this was written against."""
    return ".".join(version.split(".")[:2]) in WRITTEN_AGAINST


def _wrap(protocol_class: Any, raw_data: Any, updated: Any, closed: Any) -> None:
    """`protocol_class.handle`, wrapped: an idle connection's fast-path request of a
    taken app is answered here, every other event goes to the original."""
    original = protocol_class.handle

    async def handle(self: Any, event: Any) -> None:
        if isinstance(event, raw_data) and _serves_taken_app(self):
            request = _idle_request(self, event.data)
            if request is not None:
                await _answer(self, request, raw_data, updated, closed)
                return
        await original(self, event)

    protocol_class.handle = handle


def parse_head(data: bytes) -> tuple[str, bytes, list[tuple[bytes, bytes]]] | None:
    """(method, target, headers with lower-case names) of `data` where it is exactly one
    request head of the plain form above; None otherwise."""
    match = HEAD.fullmatch(data)
    if match is None:
        return None
    method, target, lines = match.groups()
    headers = []
    for line in lines.split(b"\r\n")[:-1]:
        name, _, value = line.partition(b":")
        name = name.lower()
        value = value.strip(b" \t")
        if (
            name in DECLINED_HEADERS
            or (name == b"content-length" and value != b"0")
            or (name == b"connection" and value.lower() != b"keep-alive")
        ):
            return None
        headers.append((name, value))
    if [name for name, _ in headers].count(b"host") != 1:
        return None  # h11 refuses an HTTP/1.1 request without one Host: leave it that
    return method.decode("ascii"), target, headers


def _serves_taken_app(protocol: Any) -> bool:
    wrapper = getattr(protocol, "app", None)
    return getattr(wrapper, "app", None) in _taken


def _idle_request(protocol: Any, data: bytes) -> dict[str, Any] | None:
    """The ASGI scope of `data` where the wire path takes it (see the module's list)."""
    connection = getattr(protocol, "connection", None)
    if not (
        isinstance(connection, h11.Connection)
        and all(hasattr(protocol, field) for field in PROTOCOL_FIELDS)
        and protocol.stream is None
        and connection.our_state is h11.IDLE
        and connection.their_state is h11.IDLE
        and connection.trailing_data == (b"", False)
        and not protocol.config.server_names
        and not protocol.context.terminated.is_set()
    ):
        return None
    head = parse_head(data)
    if head is None:
        return None
    method, target, headers = head
    path, _, query = target.partition(b"?")
    scope: dict[str, Any] = {
        "type": "http",
        "http_version": "1.1",
        "asgi": {"spec_version": "2.1", "version": "3.0"},
        "method": method,
        "scheme": "https" if protocol.ssl else "http",
        "path": unquote(path.decode("ascii")),
        "raw_path": path,
        "query_string": query,
        "root_path": protocol.config.root_path,
        "headers": headers,
        "client": getattr(protocol, "client", None),
        "server": getattr(protocol, "server", None),
        "state": dict(getattr(protocol, "connection_state", None) or {}),
        "extensions": {},
    }
    return scope if answered_here(scope) else None


async def _answer(
    protocol: Any, scope: dict[str, Any], raw_data: Any, updated: Any, closed: Any
) -> None:
    """Run the app on `scope` and write its answer, as hypercorn would."""
    started = time.time()
    await protocol.send(updated(idle=False))
    protocol.keep_alive_requests += 1
    await protocol.context.mark_request()
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    try:
        await protocol.app.app(scope, receive, send)  # hypercorn's wrapper's app
        start = next(m for m in messages if m["type"] == "http.response.start")
    except Exception:  # as hypercorn answers an app that failed before its answer
        log.exception("unhandled error on %s %s", scope["method"], scope["path"])
        start = {"status": 500, "headers": [(b"content-length", b"0"), (b"connection", b"close")]}
        messages = []
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    headers = [*start["headers"], *protocol.config.response_headers("h11")]
    if protocol.keep_alive_requests >= protocol.config.keep_alive_max_requests:
        headers.append((b"connection", b"close"))
    closing = any(
        name.lower() == b"connection" and value.lower() == b"close" for name, value in headers
    )
    head = b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers)
    await protocol.send(raw_data(data=b"HTTP/1.1 %d \r\n%s\r\n%s" % (start["status"], head, body)))
    await protocol.config.log.access(scope, start, time.time() - started)
    await protocol.send(closed() if closing else updated(idle=True))
