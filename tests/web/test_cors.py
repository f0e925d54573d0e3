"""Browser origins (CORS) on the real server, as vLLM's `--allowed-origins` and its
siblings set them: preflights answered without a key, every answer to an allowed
origin readable by its page (a 401 and a fast-path DELETE too), other origins and a
server that allows none left without the headers."""

from __future__ import annotations

from pathlib import Path

import attrs

from kvscope.web.asgi.cors import CorsPolicy
from kvscope.web.settings import ServerSettings

from .conftest import LONG, running_server, wait_clean, wait_tokens

APP = "http://app.example"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_an_allowed_origin_calls_from_a_browser(backend: str, tmp_path: Path) -> None:
    policy = CorsPolicy((APP,))
    with running_server(backend, tmp_path, cors=policy, api_keys=("k",)) as live:
        with live.client() as anonymous:
            preflight = anonymous.options("/v1/completions", headers={"Origin": APP, **PREFLIGHT})
            assert preflight.status_code == 200, preflight.text
            assert preflight.headers["access-control-allow-origin"] == APP
            assert "POST" in preflight.headers["access-control-allow-methods"]
            assert (
                preflight.headers["access-control-allow-headers"]
                == PREFLIGHT["Access-Control-Request-Headers"]
            )
            refused = anonymous.get("/v1/models", headers={"Origin": APP})
            assert refused.status_code == 401
            assert refused.headers["access-control-allow-origin"] == APP  # readable by the page
            other = anonymous.options(
                "/v1/completions", headers={"Origin": "http://other.example", **PREFLIGHT}
            )
            assert "access-control-allow-origin" not in other.headers
        with live.client("k") as client:
            answer = client.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                headers={"Origin": APP},
            )
            assert answer.status_code == 200, answer.text
            assert answer.headers["access-control-allow-origin"] == APP
            assert "Origin" in answer.headers["vary"]
            job = client.post("/generate", json={"prompt": "x", **LONG}).json()
            wait_tokens(client, job["id"])
            gone = client.delete(f"/requests/{job['id']}", headers={"Origin": APP})
            assert gone.status_code == 200 and gone.json()["blocks_released"] > 0
            assert gone.headers["access-control-allow-origin"] == APP
            plain = client.get("/v1/models")  # no Origin: not a browser's cross-origin call
            assert "access-control-allow-origin" not in plain.headers
        wait_clean(live)


def test_any_origin_and_a_refused_preflight(backend: str, tmp_path: Path) -> None:
    policy = CorsPolicy(("*",), methods=("GET", "POST"), headers=("content-type",))
    with running_server(backend, tmp_path, cors=policy) as live, live.client() as client:
        anywhere = {"Origin": "http://anywhere.example"}
        answer = client.get("/v1/models", headers=anywhere)
        assert answer.headers["access-control-allow-origin"] == "*"
        for method, headers in (("DELETE", "content-type"), ("POST", "authorization")):
            asked = {"Access-Control-Request-Method": method}
            asked["Access-Control-Request-Headers"] = headers
            preflight = client.options("/v1/completions", headers={**anywhere, **asked})
            assert preflight.status_code == 400, (method, headers)
            assert "access-control-allow-methods" not in preflight.headers
    credentials = CorsPolicy(("*",), credentials=True)
    with running_server(backend, tmp_path, cors=credentials) as live, live.client() as client:
        answer = client.get("/v1/models", headers={"Origin": APP})
        assert answer.headers["access-control-allow-origin"] == APP  # never * with cookies
        assert answer.headers["access-control-allow-credentials"] == "true"


def test_no_origin_is_allowed_unless_told(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path) as live, live.client() as client:
        preflight = client.options("/v1/completions", headers={"Origin": APP, **PREFLIGHT})
        assert "access-control-allow-origin" not in preflight.headers
        answer = client.get("/v1/models", headers={"Origin": APP})
        assert answer.status_code == 200
        assert "access-control-allow-origin" not in answer.headers


def test_a_policy_travels_in_settings_as_replicas_get_them() -> None:
    """Ray Serve replicas get their settings as `attrs.asdict` makes them."""
    settings = ServerSettings(cors=CorsPolicy(("http://a.example",), ("GET",), ("x-key",), True))
    assert ServerSettings(**attrs.asdict(settings)) == settings
