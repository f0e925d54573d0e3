"""The plain parts of kvscope.replicas: ids, routing keys, the router's pick, merging,
prefix keys and the proxy's prefix middleware."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvscope[ray]'")

from kvscope.replicas.direct import DirectHosts  # noqa: E402
from kvscope.replicas.ids import id_prefix, owner_of, routing_key  # noqa: E402
from kvscope.replicas.merge import merge_metrics, merge_stats  # noqa: E402
from kvscope.replicas.prefix import (  # noqa: E402
    PREFIX_HEADER,
    PrefixKeyMiddleware,
    preferred,
    prefix_key,
)
from kvscope.replicas.router import pick  # noqa: E402
from kvscope.replicas.stopping import serve_stopping  # noqa: E402


def test_ids_name_their_replica() -> None:
    request_id = id_prefix("ab12cd34") + "f" * 32
    assert owner_of(request_id) == "ab12cd34"
    assert owner_of("req-" + "f" * 32) is None  # the single server's ids
    assert owner_of("my-own-id") is None


def test_a_replica_listens_directly_where_the_proxy_listens() -> None:
    node = "10.0.0.7"
    assert DirectHosts.like_proxy("127.0.0.1", node) == DirectHosts("127.0.0.1", "127.0.0.1")
    assert DirectHosts.like_proxy("0.0.0.0", node) == DirectHosts("0.0.0.0", node)
    assert DirectHosts.like_proxy("::", node) == DirectHosts("::", node)
    assert DirectHosts.like_proxy(None, node) == DirectHosts(node, node)


def test_routing_key_path_then_header_then_query() -> None:
    owned = id_prefix("r1") + "0" * 32
    header = [(b"x-kvscope-replica", b"r2")]
    assert routing_key(f"/requests/{owned}", b"", header) == "r1"
    assert routing_key(f"/requests/{owned}/events", b"", []) == "r1"
    assert routing_key("/generate", b"replica=r3", header) == "r2"
    assert routing_key("/stats", b"replica=%400", []) == "@0"
    assert routing_key("/generate", b"", []) is None
    # A response is named after its request: it reaches the replica that stores it.
    response = "resp_" + owned.removeprefix("req-")
    assert routing_key(f"/v1/responses/{response}", b"", header) == "r1"
    assert routing_key(f"/v1/responses/{response}/cancel", b"", []) == "r1"
    assert routing_key(f"/v1/responses/{response}/input_items", b"", []) == "r1"
    assert routing_key("/v1/responses/resp_" + "0" * 32, b"", []) is None


def test_pick_by_name_or_index() -> None:
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n)) for n in ("b", "a")]
    assert pick(replicas, "a") is replicas[1]
    assert pick(replicas, "@0") is replicas[1] and pick(replicas, "@1") is replicas[0]
    assert pick(replicas, "@2") is None and pick(replicas, "gone") is None


def test_merging_stats_and_metrics() -> None:
    merged = merge_stats({"a": {"running": 1, "pid": 7}, "b": {"running": 2, "pid": 8}})
    assert merged["running"] == 3 and "pid" not in merged
    assert merged["replicas"]["a"]["pid"] == 7
    text = "# HELP g a gauge\n# TYPE g gauge\ng 1.0\n"
    out = merge_metrics({"a": text, "b": text})
    assert out.count("# TYPE g gauge") == 1
    assert 'g{replica="a"} 1.0' in out and 'g{replica="b"} 1.0' in out


def test_prefix_keys_group_prompts_by_their_head() -> None:
    head = "You are a careful assistant. " * 10  # longer than PREFIX_CHARS
    one = prefix_key(json.dumps({"prompt": head + "What is 2+2?"}).encode())
    two = prefix_key(json.dumps({"prompt": head + "Name a colour."}).encode())
    other = prefix_key(json.dumps({"prompt": "Translate: " + head}).encode())
    assert one is not None and one == two != other
    chat = [{"role": "system", "content": head}, {"role": "user", "content": "Hi"}]
    assert prefix_key(json.dumps({"messages": chat}).encode()) == prefix_key(
        json.dumps({"messages": [*chat[:1], {"role": "user", "content": "Bye"}]}).encode()
    )
    # A response's instructions and input head it as the chat they render would.
    response = {"instructions": head, "input": "Hi"}
    assert prefix_key(json.dumps(response).encode()) == prefix_key(
        json.dumps({"messages": chat}).encode()
    )
    items = {"instructions": head, "input": [{"role": "user", "content": "Hi"}]}
    assert prefix_key(json.dumps(items).encode()) == prefix_key(json.dumps(response).encode())
    assert prefix_key(json.dumps({"prompt": [head, "x"]}).encode()) is not None
    for bad in (b"{nope", b"[]", b'{"prompt": ""}', b'{"messages": 3}'):
        assert prefix_key(bad) is None


def test_rendezvous_prefers_one_replica_per_key_and_spreads_keys() -> None:
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n)) for n in "abc"]
    keys = [f"{i:016x}" for i in range(60)]
    chosen = [preferred(replicas, key) for key in keys]
    assert chosen == [preferred(list(reversed(replicas)), key) for key in keys]
    assert {r.replica_id.unique_id for r in chosen} == {"a", "b", "c"}
    # A replica that goes away moves only its own keys.
    rest = replicas[:2]
    for key, replica in zip(keys, chosen, strict=True):
        if replica in rest:
            assert preferred(rest, key) is replica


@pytest.mark.anyio
async def test_the_proxy_middleware_keys_a_body_and_hands_it_on_whole() -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2}).encode()
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen["headers"] = dict(scope["headers"])
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        seen["body"] = b"".join(chunks)

    incoming = [
        {"type": "http.request", "body": body[:5], "more_body": True},
        {"type": "http.request", "body": body[5:], "more_body": False},
    ]

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": []}
    await PrefixKeyMiddleware(app)(scope, receive, send)
    assert seen["body"] == body
    assert seen["headers"][PREFIX_HEADER] == prefix_key(body).encode()  # type: ignore[union-attr]
    # A call that names its replica is not read ahead.
    incoming[:] = [{"type": "http.request", "body": body, "more_body": False}]
    named = {**scope, "headers": [(b"x-kvscope-replica", b"r1")]}
    await PrefixKeyMiddleware(app)(named, receive, send)
    assert PREFIX_HEADER not in seen["headers"] and seen["body"] == body
    # A body that names where it belongs (a response it continues) is sent there.
    continued = json.dumps(
        {"input": "More", "previous_response_id": "resp_r7-" + "0" * 32}
    ).encode()
    incoming[:] = [{"type": "http.request", "body": continued, "more_body": False}]
    await PrefixKeyMiddleware(app)({**scope, "path": "/v1/responses"}, receive, send)
    assert seen["headers"][b"x-kvscope-replica"] == b"r7" and seen["body"] == continued
    assert PREFIX_HEADER not in seen["headers"]


def test_outside_a_replica_stopping_is_unknown_and_said_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where Serve's stopping flag cannot be found, the replica falls back to draining
    at the lifespan's end, and says so."""
    with caplog.at_level("WARNING", logger="kvscope.replicas"):
        assert serve_stopping() is None
    assert "graceful_shutdown_timeout_s" in caplog.text
