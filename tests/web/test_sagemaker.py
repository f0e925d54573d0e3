"""SageMaker's container contract on the real server, as vLLM serves it: `/ping`
answers as `/health` does, without a key; `/invocations` answers a body with the
route its fields name, keys and streams included; a body that names none is a 400."""

from __future__ import annotations

from pathlib import Path

from .conftest import running_server, sse_events, wait_clean

KEY = "sagemaker-key"


def test_ping_and_invocations(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path, api_keys=(KEY,)) as live:
        with live.client() as anonymous:
            for method in ("GET", "POST"):
                ping = anonymous.request(method, "/ping")
                assert ping.status_code == 200 and ping.json()["ready"] is True
            assert anonymous.post("/invocations", json={"prompt": "hi"}).status_code == 401
        with live.client(KEY) as client:
            chat = client.post(
                "/invocations",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
            text = client.post("/invocations", json={"prompt": "hi", "max_tokens": 2}).json()
            assert text["object"] == "text_completion"
            embedded = client.post("/invocations", json={"input": ["hi", "there"]}).json()
            assert [d["object"] for d in embedded["data"]] == ["embedding"] * 2
            ranked = client.post("/invocations", json={"query": "hi", "documents": ["a", "hi"]})
            assert ranked.json()["results"][0]["index"] == 1
            scored = client.post("/invocations", json={"text_1": "hi", "text_2": "hi"}).json()
            assert scored["data"][0]["object"] == "score"
            with client.stream(
                "POST", "/invocations", json={"prompt": "hi", "max_tokens": 3, "stream": True}
            ) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                assert list(sse_events(stream.iter_lines()))[-1] == "[DONE]"
            unnamed = client.post("/invocations", json={"question": "hi"})
            assert unnamed.status_code == 400 and "messages" in unnamed.json()["error"]["message"]
            bad = client.post("/invocations", json={"prompt": "hi", "max_tokens": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        wait_clean(live)
