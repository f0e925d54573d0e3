"""SSE: POST /generate with stream, and watching GET /requests/{id}/events.

Closing a generate stream cancels its request (reason `disconnect`) and leaves the
greedy requests running beside it with exactly the tokens they get alone; closing a
watcher cancels nothing.
"""

from __future__ import annotations

from .conftest import LONG, Live, alone, sse_events, wait_clean, wait_status


def test_stream_happy_path(live: Live) -> None:
    with (
        live.client() as client,
        client.stream(
            "POST",
            "/generate",
            json={
                "prompt": "Hi",
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        events = list(sse_events(response.iter_lines()))
    tokens = [e for e in events if e["type"] == "token"]
    assert all(e["id"] == request_id for e in events)
    assert sum(len(e["token_ids"]) for e in tokens) == 6
    done = events[-1]
    assert (
        done["type"] == "done"
        and done["status"] == "finished"
        and done["finish_reason"] == "length"
    )
    assert done["completion_tokens"] == 6 and done["text"] == "".join(e["text"] for e in tokens)
    assert live.audit_record(request_id)["generated_tokens"] == 6


def test_closing_the_stream_cancels_and_spares_the_others(live: Live) -> None:
    expected = alone(live, "neighbour", 300)
    with live.client() as client:
        neighbour = client.post(
            "/generate",
            json={"prompt": "neighbour", "max_tokens": 300, "temperature": 0, "ignore_eos": True},
        ).json()
        with client.stream(
            "POST", "/generate", json={"prompt": "go away", "stream": True, **LONG}
        ) as response:
            request_id = response.headers["x-request-id"]
            for event in sse_events(response.iter_lines()):
                if event["type"] == "token":
                    break  # leaving the block closes the connection
        info = wait_status(client, request_id)
        assert info["status"] == "cancelled" and info["cancel_reason"] == "disconnect"
        assert info["tokens_generated"] < LONG["max_tokens"]
        assert wait_status(client, neighbour["id"])["token_ids"] == expected
    assert live.audit_record(request_id)["cancel_reason"] == "disconnect"
    wait_clean(live)


def test_watcher_disconnect_cancels_nothing(live: Live) -> None:
    with live.client() as client:
        job = client.post(
            "/generate",
            json={"prompt": "watched", "max_tokens": 200, "temperature": 0, "ignore_eos": True},
        ).json()
        with client.stream("GET", f"/requests/{job['id']}/events") as response:
            assert response.headers["x-request-id"] == job["id"]
            for event in sse_events(response.iter_lines()):
                assert event["id"] == job["id"]
                break
        info = wait_status(client, job["id"])
        assert info["status"] == "finished" and info["tokens_generated"] == 200
        # a watcher that reads to the end gets every token from the start, then done
        with client.stream("GET", f"/requests/{job['id']}/events") as response:
            events = list(sse_events(response.iter_lines()))
        assert [t for e in events if e["type"] == "token" for t in e["token_ids"]] == info[
            "token_ids"
        ]
        assert events[-1]["type"] == "done" and events[-1]["status"] == "finished"
        assert client.get("/requests/req-unknown/events").status_code == 404
    wait_clean(live)
