"""Prefix-aware routing: calls whose prompts share a prefix go to one replica.

A replica's engine reuses the KV blocks of a prompt prefix it computed before (its
prefix cache), so prompts sharing a prefix are cheaper on the replica that saw it.
Serve's request router sees an HTTP call's path and headers, never its body (the
proxy streams the body after choosing), so the prefix is read in front of it, in
Serve's proxy: `PrefixKeyMiddleware` (installed by the proxy callback, like
`StreamEndMiddleware`) reads the body of a generation call that names no replica,
hashes the first `PREFIX_CHARS` characters of its prompt (a chat's messages, in
order; a response's `instructions` and input, as the chat they render) and adds the
hash as `X-Kvscope-Prefix`, then hands the body on unchanged. A body that names its
replica itself (a `parent`, a `previous_response_id`: where they live) gets that
replica's `X-Kvscope-Replica` instead, which spares the replica a forward.

`OwnerRouter` (router.py) prefers, for that hash, the replica that rendezvous hashing
ranks first (`preferred`): every proxy of a cluster picks the same replica for a
prefix with no shared state, and a replica that goes away moves only its own
prefixes. Plain Python (no Ray): it runs in the proxy for every call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from .ids import REPLICA_HEADER, routing_key
from .messages import parent_owner

#: The header that carries a call's prefix hash from the proxy's middleware to the router.
PREFIX_HEADER = b"x-kvscope-prefix"
#: How much of a prompt names its prefix: the shared head of prompts (a system prompt,
#: a few-shot preamble) is usually longer; a shorter key groups more prompts.
PREFIX_CHARS = 256
#: Bodies longer than this are not read ahead (the replica answers their 413).
MAX_READ = 1 << 20
#: The calls that carry a prompt.
PROMPT_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")

Message = dict[str, Any]


def prefix_key(body: bytes) -> str | None:
    """The hash of the first `PREFIX_CHARS` characters of a body's prompt, or None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    head = _prompt_head(data)
    if not head:
        return None
    return hashlib.blake2b(head[:PREFIX_CHARS].encode(), digest_size=8).hexdigest()


def _prompt_head(data: dict[str, Any]) -> str:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt
    if prompt is not None:
        return json.dumps(prompt)[:PREFIX_CHARS]  # token ids
    messages = data.get("messages")
    if messages is None and "input" in data:  # the Responses API: as the chat it renders
        given = data["input"]
        messages = [{"role": "user", "content": given}] if isinstance(given, str) else given
        if isinstance(messages, list) and isinstance(data.get("instructions"), str):
            messages = [{"role": "system", "content": data["instructions"]}, *messages]
    if not isinstance(messages, list):
        return ""
    head = ""
    for message in messages:
        if len(head) >= PREFIX_CHARS:
            break
        if isinstance(message, dict):
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            head += f"{message.get('role')}:{text}\n"
    return head


def preferred(replicas: Sequence[Any], key: str) -> Any:
    """The replica rendezvous hashing ranks first for `key` (by Serve unique id)."""

    def weight(replica: Any) -> bytes:
        name = f"{key}/{replica.replica_id.unique_id}".encode()
        return hashlib.blake2b(name, digest_size=8).digest()

    return max(replicas, key=weight)


class PrefixKeyMiddleware:
    """In Serve's proxy: a generation call that names no replica gets `X-Kvscope-Prefix`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in PROMPT_ROUTES
            or routing_key(scope["path"], scope.get("query_string", b""), scope["headers"])
        ):
            await self.app(scope, receive, send)
            return
        read: list[Message] = []
        size, more = 0, True
        while more and size <= MAX_READ:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":  # the client went away
                break
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(m.get("body", b"") for m in read)
        owner = None if more else parent_owner(body)
        key = None if more or owner else prefix_key(body)
        if owner is not None:
            header = (REPLICA_HEADER.encode(), owner.encode())
            scope = {**scope, "headers": [*scope["headers"], header]}
        elif key is not None:
            scope = {**scope, "headers": [*scope["headers"], (PREFIX_HEADER, key.encode())]}

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)
