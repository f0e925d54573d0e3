"""API keys: a bearer key on every route but /health; a key sees only its own requests."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from kvscope.web.settings import key_id

from .conftest import LONG, running_server, wait_clean, wait_tokens


def test_keys(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path, api_keys=("alpha", "beta")) as live:
        with (
            live.client() as anonymous,
            live.client("alpha") as alpha,
            live.client("beta") as beta,
            live.client("wrong") as wrong,
        ):
            assert anonymous.get("/health").status_code == 200
            assert anonymous.get("/").status_code == 200  # the dashboard's page holds no data
            for method, path in [
                ("POST", "/generate"),
                ("GET", "/requests"),
                ("GET", "/stats"),
                ("GET", "/metrics"),
                ("GET", "/openapi.json"),
                ("DELETE", "/requests/req-x"),
                ("POST", "/v1/completions"),
                ("GET", "/v1/models"),
                ("POST", "/tokenize"),
                ("POST", "/detokenize"),
            ]:
                for client in (anonymous, wrong):
                    response = client.request(method, path, json={"prompt": "x"})
                    assert response.status_code == 401, (method, path)
                    assert response.json()["error"]["type"] == "authentication_error"
            job = alpha.post("/generate", json={"prompt": "mine", **LONG}).json()
            wait_tokens(alpha, job["id"])
            assert beta.get(f"/requests/{job['id']}").status_code == 404
            assert beta.get(f"/requests/{job['id']}/events").status_code == 404
            assert beta.delete(f"/requests/{job['id']}").status_code == 404
            # with a body, the Quart route answers instead of FastPath: the same rule
            with_body = beta.request("DELETE", f"/requests/{job['id']}", content=b"{}")
            assert with_body.status_code == 404
            assert (
                beta.post("/generate", json={"prompt": "x", "parent": job["id"]}).status_code == 404
            )
            assert beta.get("/requests").json()["requests"] == []
            assert [r["id"] for r in alpha.get("/requests").json()["requests"]] == [job["id"]]
            assert alpha.delete(f"/requests/{job['id']}").status_code == 200
            with pytest.raises(InvalidStatus):
                with connect(live.ws_url + "/ws/generate"):
                    pass
            with connect(
                live.ws_url + "/ws/generate", additional_headers={"Authorization": "Bearer beta"}
            ) as ws:
                ws.send(json.dumps({"prompt": "ws", "max_tokens": 2}))
                assert json.loads(ws.recv(timeout=30))["type"] == "start"
            with openai.OpenAI(base_url=live.url + "/v1", api_key="beta", max_retries=0) as oai:
                assert (
                    oai.completions.create(
                        model="tiny-random", prompt="hi", max_tokens=2
                    ).usage.completion_tokens
                    >= 1
                )
            with openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0) as oai:
                with pytest.raises(openai.AuthenticationError):
                    oai.models.list()
        wait_clean(live)
        record = live.audit_record(job["id"])
        assert record["key"] == key_id("alpha") and record["cancelled_by"] == key_id("alpha")
        assert "alpha" not in live.audit_path.read_text()
