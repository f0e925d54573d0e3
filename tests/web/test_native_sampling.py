"""The sampling fields on the native API's WebSocket: logprobs in its token events,
a penalty and a grammar honoured, a bad bias refused."""

from __future__ import annotations

import json
import re

from websockets.sync.client import connect

from .conftest import Live, wait_clean


def _until_done(ws) -> list[dict]:
    events = []
    while True:
        events.append(json.loads(ws.recv(timeout=30)))
        if events[-1]["type"] in ("done", "error"):
            return events


def test_websocket_takes_the_sampling_fields(live: Live) -> None:
    with connect(live.ws_url + "/ws/generate") as ws:
        base = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        ws.send(json.dumps({**base, "logprobs": 2}))
        tokens = [e for e in _until_done(ws) if e["type"] == "token"]
        entries = [lp for e in tokens for lp in e["logprobs"]]
        assert len(entries) == sum(len(e["token_ids"]) for e in tokens) == 6
        ids = [t for e in tokens for t in e["token_ids"]]
        # Greedy: each chosen token is the first of its top 2.
        assert all(lp["top"][0] == [t, lp["logprob"]] for t, lp in zip(ids, entries, strict=True))
        ws.send(json.dumps({**base, "logit_bias": {str(ids[0]): -100}}))
        banned = [t for e in _until_done(ws) if e["type"] == "token" for t in e["token_ids"]]
        assert len(banned) == 6 and ids[0] not in banned
        ws.send(json.dumps({**base, "max_tokens": 10, "guided_regex": "[0-9]{4}"}))
        assert re.fullmatch("[0-9]{4}", _until_done(ws)[-1]["text"])
        ws.send(json.dumps({**base, "logit_bias": {"x": 1}}))
        error = _until_done(ws)[-1]
        assert error["type"] == "error" and "logit_bias" in error["error"]["message"]
    wait_clean(live)
