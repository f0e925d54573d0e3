"""WS /ws/generate: tokens then done; `{"type":"cancel"}`; disconnect cancels."""

from __future__ import annotations

import json

from websockets.sync.client import connect

from .conftest import LONG, Live, alone, wait_clean, wait_status


def _until_done(ws) -> list[dict]:
    events = []
    while True:
        event = json.loads(ws.recv(timeout=30))
        events.append(event)
        if event["type"] in ("done", "error"):
            return events


def test_websocket_generate_twice_on_one_socket(live: Live) -> None:
    with connect(live.ws_url + "/ws/generate") as ws:
        for prompt in ("one", "two"):
            ws.send(
                json.dumps(
                    {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
                )
            )
            events = _until_done(ws)
            assert events[0]["type"] == "start"
            request_id = events[0]["id"]
            assert all(e["id"] == request_id for e in events)
            assert sum(len(e["token_ids"]) for e in events if e["type"] == "token") == 5
            assert events[-1]["status"] == "finished"
        ws.send("not json")
        error = json.loads(ws.recv(timeout=30))
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        ws.send(json.dumps({"prompt": "x", "max_tokens": -1}))
        assert json.loads(ws.recv(timeout=30))["type"] == "error"
    wait_clean(live)


def test_websocket_cancel_message(live: Live) -> None:
    expected = alone(live, "bystander", 30)
    with live.client() as client:
        bystander = client.post(
            "/generate",
            json={"prompt": "bystander", "max_tokens": 30, "temperature": 0, "ignore_eos": True},
        ).json()
        with connect(live.ws_url + "/ws/generate") as ws:
            ws.send(json.dumps({"type": "generate", "prompt": "cancel me", **LONG}))
            start = json.loads(ws.recv(timeout=30))
            assert json.loads(ws.recv(timeout=30))["type"] == "token"
            ws.send(json.dumps({"type": "cancel"}))
            done = _until_done(ws)[-1]
            assert (
                done["type"] == "done"
                and done["status"] == "cancelled"
                and done["cancel_reason"] == "user"
            )
        info = wait_status(client, start["id"])
        assert info["cancel_reason"] == "user"
        assert wait_status(client, bystander["id"])["token_ids"] == expected
    assert live.audit_record(start["id"])["cancel_reason"] == "user"
    wait_clean(live)


def test_websocket_disconnect_cancels(live: Live) -> None:
    with connect(live.ws_url + "/ws/generate") as ws:
        ws.send(json.dumps({"prompt": "bye", **LONG}))
        start = json.loads(ws.recv(timeout=30))
        assert json.loads(ws.recv(timeout=30))["type"] == "token"
    with live.client() as client:
        info = wait_status(client, start["id"])
    assert info["status"] == "cancelled" and info["cancel_reason"] == "disconnect"
    assert live.audit_record(start["id"])["cancel_reason"] == "disconnect"
    wait_clean(live)
