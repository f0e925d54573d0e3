"""The native jobs API: POST /generate, GET /requests[/{id}], DELETE /requests/{id}."""

from __future__ import annotations

import httpx

from .conftest import LONG, Live, wait_clean, wait_status, wait_tokens


def test_generate_runs_a_detached_job(live: Live) -> None:
    with live.client() as client:
        response = client.post(
            "/generate",
            json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        assert response.status_code == 202
        body = response.json()
        assert body["id"].startswith("req-") and body["status"] in ("queued", "running")
        info = wait_status(client, body["id"])
        assert info["status"] == "finished" and info["finish_reason"] == "length"
        assert info["tokens_generated"] == 8 and len(info["token_ids"]) == 8
        assert info["prompt_tokens"] == 6 and info["parent"] is None and info["children"] == []
        assert "owner" not in info
    assert live.audit_record(body["id"])["finish_reason"] == "length"
    assert wait_clean(live)["kv_blocks_in_use"] == 0


def test_prompt_token_ids_and_list(live: Live) -> None:
    with live.client() as client:
        job = client.post("/generate", json={"prompt_token_ids": [256, 72, 105], **LONG}).json()
        listed = client.get("/requests").json()["requests"]
        assert job["id"] in [r["id"] for r in listed]
        client.delete(f"/requests/{job['id']}")
        assert wait_status(client, job["id"])["prompt_tokens"] == 3


def test_delete_cancels_with_reason_user(live: Live) -> None:
    with live.client() as client:
        job = client.post("/generate", json={"prompt": "cancel me", **LONG}).json()
        wait_tokens(client, job["id"])
        response = client.delete(f"/requests/{job['id']}")
        assert response.status_code == 200
        report = response.json()
        assert report["found"] and report["status"] == "running" and report["blocks_released"] >= 1
        assert report["release_seconds"] is not None and report["release_seconds"] < 1.0
        assert report["reply_seconds"] >= report["release_seconds"]
        info = client.get(f"/requests/{job['id']}").json()
        assert (
            info["status"] == "cancelled"
            and info["cancel_reason"] == "user"
            and info["finish_reason"] == "cancelled"
        )
        assert client.get("/requests").json()["requests"] == []
        # twice: the second finds it ended
        again = client.delete(f"/requests/{job['id']}")
        assert again.status_code == 409 and again.json()["error"]["status"] == "cancelled"
    record = live.audit_record(job["id"])
    assert record["cancel_reason"] == "user" and record["cancelled_by"] == "api"
    wait_clean(live)


def test_delete_unknown_and_finished(live: Live) -> None:
    with live.client() as client:
        missing = client.delete("/requests/req-nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        assert client.get("/requests/req-nope").status_code == 404
        job = client.post(
            "/generate", json={"prompt": "x", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        ).json()
        wait_status(client, job["id"])
        finished = client.delete(f"/requests/{job['id']}")
        assert finished.status_code == 409
        assert finished.json()["error"] == {
            "message": finished.json()["error"]["message"],
            "type": "conflict_error",
            "status": "finished",
        }


def test_delete_answers_alike_with_and_without_a_body(live: Live) -> None:
    """A bodiless DELETE is answered below Quart (`FastPath`), one with a body by the
    Quart route; both apply one rule, so every answer is the same."""

    def both(client: httpx.Client, request_id: str) -> list[tuple[int, dict]]:
        answers = []
        for content in (None, b"{}"):
            response = client.request("DELETE", f"/requests/{request_id}", content=content)
            assert response.headers["content-type"] == "application/json"
            answers.append((response.status_code, response.json()))
        return answers

    with live.client() as client:
        (missing, missing_too) = both(client, "req-nope")
        assert missing == missing_too and missing[0] == 404
        job = client.post("/generate", json={"prompt": "cancel me twice", **LONG}).json()
        wait_tokens(client, job["id"])
        (cancelled, ended) = both(client, job["id"])
        assert cancelled[0] == 200 and cancelled[1]["status"] == "running"
        assert ended[0] == 409 and ended[1]["error"]["status"] == "cancelled"
        assert both(client, job["id"]) == [ended, ended]
        other = client.post("/generate", json={"prompt": "cancel me with a body", **LONG}).json()
        wait_tokens(client, other["id"])
        response = client.request("DELETE", f"/requests/{other['id']}", content=b"{}")
        assert response.status_code == 200 and set(response.json()) == set(cancelled[1])
    wait_clean(live)


def test_delete_cancels_children(live: Live) -> None:
    with live.client() as client:
        parent = client.post("/generate", json={"prompt": "parent", **LONG}).json()
        child = client.post(
            "/generate", json={"prompt": "parent and child", "parent": parent["id"], **LONG}
        ).json()
        assert client.get(f"/requests/{parent['id']}").json()["children"] == [child["id"]]
        wait_tokens(client, child["id"])
        report = client.delete(f"/requests/{parent['id']}").json()
        assert report["cancelled_children"] == 1
        info = wait_status(client, child["id"])
        assert info["status"] == "cancelled" and info["parent"] == parent["id"]
        assert info["cancel_reason"] == "parent"
    assert live.audit_record(child["id"])["cancel_reason"] == "parent"
    wait_clean(live)


def test_timeout_cancels_with_reason_timeout(live: Live) -> None:
    with live.client() as client:
        job = client.post("/generate", json={"prompt": "slow", "timeout": 0.3, **LONG}).json()
        info = wait_status(client, job["id"])
        assert info["status"] == "cancelled" and info["cancel_reason"] == "timeout"
    assert live.audit_record(job["id"])["cancel_reason"] == "timeout"
    wait_clean(live)
