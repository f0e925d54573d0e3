"""ASGI message helpers of a replica: capture, replay and plain JSON answers.

What `ReplicaApp` does with one call's messages besides handing them to the Quart app:
run the app into a buffer (`capture`), send captured messages on (`replay`), give a
body read ahead back to the app (`replay_body`), answer JSON itself (`json_answer`);
and what a call's headers say to a replica (`call_timeout`, `is_forwarded`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from .ids import id_owner

#: Serve's per-call timeout header (it overrides `request_timeout_s`; <= 0 disables).
TIMEOUT_HEADER = b"x-request-timeout-seconds"
#: Marks a call one replica forwarded to another (never forwarded again).
FORWARDED_HEADER = b"x-kvscope-forwarded"

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def parent_owner(body: str | bytes) -> str | None:
    """The replica that owns the `parent` a JSON body names (a request), or its
    `previous_response_id` (a stored response), if it names one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None  # the local app answers the 400
    if not isinstance(data, dict):
        return None
    parent = data.get("parent", data.get("previous_response_id"))
    return id_owner(parent) if isinstance(parent, str) else None


async def read_body(receive: Receive) -> bytes | None:
    """An HTTP call's whole body; None if the client left first."""
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def replay_body(body: bytes, then: Receive) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive


async def capture(app: Any, scope: Message, receive: Receive) -> Message:
    messages: list[Message] = []

    async def send(message: Message) -> None:
        messages.append(message)

    await app(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    headers = dict(start.get("headers", []))
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return {
        "status": start["status"],
        "content_type": headers.get(b"content-type", b"").decode(),
        "body": body,
        "messages": messages,
    }


async def replay(messages: list[Message], send: Send) -> None:
    for message in messages:
        await send(message)


def error_body(message: str, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_}}


async def json_answer(send: Send, status: int, body: Any) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": data})


def is_forwarded(scope: Message) -> bool:
    """Whether another replica forwarded this call (it is never forwarded again)."""
    return any(name.lower() == FORWARDED_HEADER for name, _ in scope.get("headers", ()))


def call_timeout(headers: Any, default: float | None) -> float | None:
    """Serve's end-to-end timeout of a call: its header's, else `default`."""
    for name, value in headers:
        if name.lower() == TIMEOUT_HEADER:
            try:
                seconds = float(value)
            except ValueError:
                return default  # as Serve reads it
            return seconds if seconds > 0 else None
    return default
