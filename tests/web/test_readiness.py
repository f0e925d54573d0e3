"""GET /ready, `readiness` in /stats and `kvscope_ready` in /metrics: warming while the
model worker process starts (it serves meanwhile), then ready, and never back."""

from __future__ import annotations

from pathlib import Path

import httpx

from .conftest import running_server, wait_for


def test_warming_until_the_model_worker_is_up_then_ready(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path, worker="process") as live, live.client() as client:
        # A model worker process takes seconds to import torch and load the model; the
        # server answers at once, on its own copy.
        first = client.get("/ready")
        assert first.status_code == 503, first.text
        assert "model worker" in first.json()["warming"]
        assert client.get("/health").status_code == 200  # alive, and serving
        served = client.post("/generate", json={"prompt": "a", "max_tokens": 2, "stream": False})
        assert served.status_code == 202

        seen: list[tuple[int, str, bool]] = []

        def ready() -> bool:
            answer = client.get("/ready")
            stats = client.get("/stats").json()
            body = answer.json()
            assert (answer.status_code == 200) == (body["readiness"] == "ready")
            assert (body["readiness"] == "ready") == (not body["warming"])
            seen.append((answer.status_code, body["readiness"], bool(stats["worker_pid"])))
            return answer.status_code == 200

        wait_for(ready, timeout=180, what="the server to be ready")
        statuses = [status for status, _, _ in seen]
        assert statuses == sorted(statuses, reverse=True)  # 503 ... 503 200: never back
        stats = client.get("/stats").json()
        assert stats["readiness"] == "ready" and stats["warming"] == [] and stats["worker_pid"]
        assert "kvscope_ready 1.0" in client.get("/metrics").text


def test_ready_needs_no_key(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path, api_keys=("secret",), worker="thread") as live:
        # A thread worker's warm-up and the kernel build end on their own.
        wait_for(
            lambda: httpx.get(live.url + "/ready").status_code == 200,
            timeout=180,
            what="the server to be ready",
        )
        assert httpx.get(live.url + "/stats").status_code == 401
        metrics = httpx.get(live.url + "/metrics", headers={"Authorization": "Bearer secret"}).text
        assert "kvscope_ready 1.0" in metrics
