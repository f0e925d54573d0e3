"""Every cancel path through Ray Serve's proxy ends the request's scope on its replica."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvscope[ray]'")

from kvscope.replicas.ids import owner_of  # noqa: E402

from .conftest import LONG, Cluster, wait_for  # noqa: E402


def _status(client: httpx.Client, request_id: str, status: str = "cancelled") -> dict[str, Any]:
    last: dict[str, Any] = {}

    def check() -> dict[str, Any] | None:
        last.update(client.get(f"/requests/{request_id}").json())
        return last if last.get("status") == status else None

    try:
        return wait_for(check, what=f"{request_id} {status}")
    except AssertionError:
        raise AssertionError(f"{request_id} not {status}: {last}") from None


def _first_event(lines: Any) -> dict[str, Any]:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended before its first event")


def test_closing_an_sse_stream_cancels_on_the_owner(live: Cluster) -> None:
    with live.client() as client:
        with client.stream(
            "POST", "/generate", json={"prompt": "Tell", "stream": True, **LONG}
        ) as s:
            request_id = _first_event(s.iter_lines())["id"]
        info = _status(client, request_id)
        assert info["cancel_reason"] == "disconnect"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_closing_an_openai_stream_cancels_on_the_owner(live: Cluster, route: str) -> None:
    # Within the small test pools' context: a longer completion is a 400 (issue 14).
    body: dict[str, Any] = {"stream": True, "max_tokens": 400, "n": 2, "ignore_eos": True}
    if route == "/v1/completions":
        body["prompt"] = "Tell me"
    else:
        body["messages"] = [{"role": "user", "content": "Tell me"}]
    with live.client() as client:
        with client.stream("POST", route, json=body) as stream:
            request_id = stream.headers["x-kvscope-request-id"]
            _first_event(stream.iter_lines())
        info = _status(client, request_id)
        assert info["cancel_reason"] == "disconnect"
        for child in info["children"]:
            assert _status(client, child)["cancel_reason"] in ("disconnect", "parent")


def test_a_websocket_cancel_and_a_websocket_disconnect(live: Cluster) -> None:
    with live.client() as client:
        with connect(f"{live.ws_url}/ws/generate") as ws:
            ws.send(json.dumps({"prompt": "Hello there", **LONG}))
            start = json.loads(ws.recv())
            assert start["type"] == "start"
            assert json.loads(ws.recv())["type"] == "token"
            ws.send(json.dumps({"type": "cancel"}))
            while (event := json.loads(ws.recv()))["type"] != "done":
                pass
            assert event["status"] == "cancelled" and event["cancel_reason"] == "user"
            ws.send(json.dumps({"prompt": "Again", **LONG}))
            second = json.loads(ws.recv())["id"]
            assert json.loads(ws.recv())["type"] == "token"
        assert _status(client, second)["cancel_reason"] == "disconnect"
        assert owner_of(second) in live.replicas()


def test_a_serve_request_timeout_cancels_with_reason_timeout(live: Cluster) -> None:
    """Serve's per-call timeout header: the proxy cuts the stream after 1.5 s."""
    with live.client() as client:
        headers = {"x-request-timeout-seconds": "1.5"}
        body = {"prompt": "Slowly", "stream": True, **LONG}
        with client.stream("POST", "/generate", json=body, headers=headers) as stream:
            lines = stream.iter_lines()
            request_id = _first_event(lines)["id"]
            for _ in lines:  # until the proxy cuts it
                pass
        info = _status(client, request_id)
        assert info["cancel_reason"] == "timeout"


def test_closing_a_forwarded_child_stream_cancels_it(live: Cluster) -> None:
    """A child's stream that went through the other replica: its disconnect still
    reaches the owner (the forward's connection closes too)."""
    with live.client() as client:
        parent = client.post("/generate", json={"prompt": "Root", **LONG}).json()["id"]
        other = next(name for name in live.replicas() if name != owner_of(parent))
        body = {"prompt": "Leaf", "parent": parent, "stream": True, **LONG}
        headers = {"X-Kvscope-Replica": other}
        with client.stream("POST", "/generate", json=body, headers=headers) as stream:
            child = _first_event(stream.iter_lines())["id"]
        assert owner_of(child) == owner_of(parent)
        assert _status(client, child)["cancel_reason"] == "disconnect"
        assert client.get(f"/requests/{parent}").json()["status"] == "running"
        client.delete(f"/requests/{parent}")


def _until_done(ws: Any) -> dict[str, Any]:
    while (event := json.loads(ws.recv()))["type"] != "done":
        pass
    return event


def test_a_websocket_child_runs_on_its_parents_replica(live: Cluster) -> None:
    """A socket opened on the other replica: a body naming a parent runs on the
    parent's replica (cancelled with it, by a cancel message, by the socket's close);
    a body without one runs where the socket is."""
    with live.client() as client:
        parent = client.post("/generate", json={"prompt": "Root", **LONG}).json()["id"]
        owner = owner_of(parent)
        assert owner is not None
        other = next(name for name in live.replicas() if name != owner)
        headers = {"X-Kvscope-Replica": other}
        with connect(f"{live.ws_url}/ws/generate", additional_headers=headers) as ws:
            ws.send(json.dumps({"prompt": "Leaf", "parent": parent, **LONG}))
            child = json.loads(ws.recv())
            assert child["type"] == "start" and owner_of(child["id"]) == owner, child
            assert json.loads(ws.recv())["type"] == "token"
            assert client.delete(f"/requests/{parent}").json()["cancelled_children"] == 1
            done = _until_done(ws)
            assert done["status"] == "cancelled" and done["cancel_reason"] == "parent", done
            # The socket is its replica's again.
            ws.send(json.dumps({"prompt": "Alone", "max_tokens": 2}))
            assert owner_of(json.loads(ws.recv())["id"]) == other
            assert _until_done(ws)["status"] == "finished"
            pinned = {"X-Kvscope-Replica": owner}
            body = {"prompt": "Root", **LONG}
            parent = client.post("/generate", json=body, headers=pinned).json()["id"]
            ws.send(json.dumps({"prompt": "Leaf", "parent": parent, **LONG}))
            assert json.loads(ws.recv())["type"] == "start"
            ws.send(json.dumps({"type": "cancel"}))
            assert _until_done(ws)["cancel_reason"] == "user"
            ws.send(json.dumps({"prompt": "Leaf", "parent": parent, **LONG}))
            last = json.loads(ws.recv())["id"]
            assert json.loads(ws.recv())["type"] == "token"
        assert _status(client, last)["cancel_reason"] == "disconnect"
        assert client.get(f"/requests/{parent}").json()["status"] == "running"
        client.delete(f"/requests/{parent}")
