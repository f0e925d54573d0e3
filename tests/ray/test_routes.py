"""Every route through Ray Serve's proxy, and ids that reach their owning replica."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvscope[ray]'")

from kvscope import Engine  # noqa: E402
from kvscope.replicas.ids import owner_of  # noqa: E402
from kvscope.web.openai.responses.ids import response_id  # noqa: E402

from .conftest import LONG, Cluster, wait_for  # noqa: E402

#: A request's statuses before it ends.
LIVE = ("queued", "running")


def test_routes_answer_as_on_the_single_server(live: Cluster) -> None:
    with live.client() as client:
        assert client.get("/health").json()["ready"] is True
        assert client.get("/v1/models").json()["data"]
        done = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert done.status_code == 200, done.text
        assert done.json()["choices"][0]["finish_reason"] == "length"
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert chat.status_code == 200, chat.text
        embedded = client.post("/v1/embeddings", json={"input": ["Hi", "there"]})
        assert embedded.status_code == 200, embedded.text
        assert len(embedded.json()["data"]) == 2
        assert owner_of(embedded.json()["id"].removeprefix("embd-")) in live.replicas()
        ranked = client.post("/rerank", json={"query": "Hi", "documents": ["x", "Hi"]})
        assert ranked.status_code == 200 and ranked.json()["results"][0]["index"] == 1
        assert client.get("/ping").json()["ready"] is True
        bad = client.post("/generate", json={"prompt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["message"]
        unknown = client.get("/requests/req-" + "0" * 32)
        assert unknown.status_code == 404


def test_ids_name_their_replica_and_every_call_reaches_it(live: Cluster) -> None:
    """Jobs land on both replicas; look-up, events and DELETE each reach the owner."""
    owners: dict[str, str] = {}
    with live.client() as client:
        while len(set(owners.values())) < 2:
            # Distinct prompts: one prompt's jobs would all go to its prefix's replica.
            prompt = f"Once upon a time {len(owners)}"
            job = client.post("/generate", json={"prompt": prompt, **LONG})
            assert job.status_code == 202, job.text
            owner = owner_of(job.json()["id"])
            assert owner in live.replicas()
            owners[job.json()["id"]] = owner
            assert len(owners) < 20, "the router sent every job to one replica"
        listed = {r["id"] for r in client.get("/requests").json()["requests"]}
        assert set(owners) <= listed  # gathered from both replicas
        for request_id, owner in owners.items():
            info = client.get(f"/requests/{request_id}")
            assert info.status_code == 200, info.text
            assert info.headers["x-kvscope-replica"] == owner
            with client.stream("GET", f"/requests/{request_id}/events") as events:
                assert events.headers["x-kvscope-replica"] == owner
                first = json.loads(next(events.iter_lines()).removeprefix("data: "))
                assert first["id"] == request_id
            report = client.delete(f"/requests/{request_id}")
            assert report.status_code == 200, report.text
            assert report.headers["x-kvscope-replica"] == owner
            assert report.json()["found"] and report.json()["blocks_released"] > 0
            again = client.delete(f"/requests/{request_id}")
            assert again.status_code == 409 and again.json()["error"]["status"] == "cancelled"
            info = client.get(f"/requests/{request_id}").json()
            assert info["status"] == "cancelled" and info["cancel_reason"] == "user"


def test_the_x_request_id_a_client_reads_finds_and_cancels_its_request(live: Cluster) -> None:
    """Serve's proxy appends its own id to `X-Request-Id`; the client reads kvscope's id
    alone, and GET and DELETE by it reach the request, streamed or not (a finished one
    is found, and its DELETE says it has ended)."""
    streamed = {"prompt": "Tell me", "stream": True, "max_tokens": 3000, "ignore_eos": True}
    background = {"input": "A story", "background": True, "max_output_tokens": 3000}
    with live.client() as client:
        with client.stream("POST", "/v1/completions", json=streamed) as stream:
            request_id = _the_request_id(stream.headers, live)
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            _found(client, request_id, LIVE)
            report = client.delete(f"/requests/{request_id}")
            assert report.status_code == 200 and report.json()["found"], report.text
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "cancelled"
        started = client.post("/v1/responses", json={**background, "ignore_eos": True})
        assert started.status_code == 200, started.text
        request_id = _the_request_id(started.headers, live)
        assert started.json()["id"] == response_id(request_id)
        _found(client, request_id, LIVE)
        report = client.delete(f"/requests/{request_id}")
        assert report.status_code == 200 and report.json()["found"], report.text
        done = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert done.status_code == 200, done.text
        request_id = _the_request_id(done.headers, live)
        _found(client, request_id, ("finished",))
        again = client.delete(f"/requests/{request_id}")
        assert again.status_code == 409 and again.json()["error"]["status"] == "finished"


def _the_request_id(headers: httpx.Headers, live: Cluster) -> str:
    """The one `X-Request-Id` of a response: an id of a running replica's."""
    (request_id,) = headers.get_list("x-request-id")
    assert owner_of(request_id) in live.replicas(), request_id
    assert headers["x-kvscope-request-id"] == request_id
    return request_id


def _found(client: httpx.Client, request_id: str, statuses: tuple[str, ...]) -> None:
    info = client.get(f"/requests/{request_id}")
    assert info.status_code == 200, info.text
    assert info.json()["id"] == request_id and info.json()["status"] in statuses, info.text


def test_a_child_starts_on_its_parents_replica(live: Cluster) -> None:
    """Sent to the other replica on purpose, a child body is forwarded to the parent's
    replica, so cancelling the parent cancels it by scope nesting."""
    with live.client() as client:
        parent = client.post("/generate", json={"prompt": "A story", **LONG}).json()["id"]
        owner = owner_of(parent)
        other = next(name for name in live.replicas() if name != owner)
        children = []
        for _ in range(3):
            child = client.post(
                "/generate",
                json={"prompt": "A branch", "parent": parent, **LONG},
                headers={"X-Kvscope-Replica": other},
            )
            assert child.status_code == 202, child.text
            assert owner_of(child.json()["id"]) == owner
            children.append(child.json()["id"])
        report = client.delete(f"/requests/{parent}").json()
        assert report["cancelled_children"] == 3
        for child_id in children:
            info = client.get(f"/requests/{child_id}").json()
            assert info["status"] == "cancelled" and info["cancel_reason"] == "parent"


def test_openai_n_samples_share_one_replica(live: Cluster) -> None:
    with live.client() as client:
        answer = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "n": 3})
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"]) == 3


def test_every_replica_serves_the_lora_adapter(live: Cluster) -> None:
    """`--lora-modules` reaches every replica: completions that name the adapter land on
    both, and each answers with the adapter's tokens, those of an engine in this process
    with the same adapter (not the base model's)."""
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answers: dict[str, tuple[str, str]] = {}  # prompt -> (replica, text)
    with live.client() as client:
        listed = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
        assert listed["sql"]["parent"] != "sql" and listed["sql"]["parent"] in listed
        while len({replica for replica, _ in answers.values()}) < 2:
            prompt = f"Once upon a time {len(answers)}"
            done = client.post("/v1/completions", json={"model": "sql", "prompt": prompt, **greedy})
            assert done.status_code == 200, done.text
            assert done.json()["model"] == "sql"
            answers[prompt] = (done.headers["x-kvscope-replica"], done.json()["choices"][0]["text"])
            assert len(answers) < 20, "the router sent every completion to one replica"
        base = client.post("/v1/completions", json={"prompt": next(iter(answers)), **greedy})
        assert base.status_code == 200, base.text

    async def reference() -> dict[str, str]:
        async with Engine.open(
            str(live.model), device="cpu", lora_modules={"sql": str(live.adapter)}, model_threads=1
        ) as engine:
            return {
                prompt: (await engine.generate(prompt, lora="sql", **greedy)).text
                for prompt in answers
            }

    expected = anyio.run(reference)
    assert {prompt: text for prompt, (_, text) in answers.items()} == expected
    assert base.json()["choices"][0]["text"] != expected[next(iter(answers))]


def test_stats_and_metrics_gather_every_replica(live: Cluster) -> None:
    with live.client() as client:
        client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        stats = client.get("/stats").json()
        assert len(stats["replicas"]) == 2
        assert stats["kv_blocks_total"] == sum(
            s["kv_blocks_total"] for s in stats["replicas"].values()
        )
        one = next(iter(stats["replicas"]))
        alone = client.get("/stats", params={"replica": one}).json()
        assert alone["replica"] == one and "replicas" not in alone
        text = client.get("/metrics").text
        for name in stats["replicas"]:
            assert f'kvscope_kv_blocks_total{{replica="{name}"}}' in text
        assert 'kvscope_requests_total{replica="' in text


def test_an_id_of_a_replica_that_is_gone_answers_404_saying_so(live: Cluster) -> None:
    with live.client() as client:
        gone = "req-zzzzzzzz-" + "0" * 32
        for method in ("GET", "DELETE"):
            answer = client.request(method, f"/requests/{gone}")
            assert answer.status_code == 404
            assert "replica zzzzzzzz" in answer.json()["error"]["message"]
        with client.stream("GET", f"/requests/{gone}/events") as events:
            assert events.status_code == 404


def test_a_bad_body_is_a_400_not_a_500(live: Cluster) -> None:
    with httpx.Client(base_url=live.url, timeout=30) as client:
        assert client.post("/generate", content=b"{nope").status_code == 400
        wait_for(lambda: client.get("/health").status_code == 200)


def test_prompts_that_share_a_prefix_go_to_one_replica(live: Cluster) -> None:
    """Sent one at a time (load balanced), prompts with one head all reach the replica
    that rendezvous hashing prefers for it, whose prefix cache then serves them."""
    head = "A shared preamble about rivers and stones, long enough to fill blocks. " * 5
    before = live.replicas()
    with live.client() as client:
        answered = set()
        for question in range(5):
            body = {"prompt": f"{head}\nQuestion {question}?", "max_tokens": 2}
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            answered.add(answer.headers["x-kvscope-replica"])
    assert len(answered) == 1, answered
    (replica,) = answered
    after = live.replicas()[replica]
    assert after["prompt_tokens_reused"] - before[replica]["prompt_tokens_reused"] > 0


def test_a_stored_response_is_found_cancelled_and_continued_on_its_replica(live: Cluster) -> None:
    """Responses are stored where they ran: retrieving, cancelling and continuing one
    (`previous_response_id`, sent to the other replica on purpose) reach that replica."""
    with live.client() as client:
        first = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 3})
        assert first.status_code == 200, first.text
        stored = first.json()
        owner = first.headers["x-kvscope-replica"]
        other = next(name for name in live.replicas() if name != owner)
        for _ in range(4):  # each would miss half the time on a replica of Serve's choice
            again = client.get(f"/v1/responses/{stored['id']}")
            assert again.status_code == 200 and again.json() == stored
        continued = client.post(
            "/v1/responses",
            json={"input": "More", "previous_response_id": stored["id"], "max_output_tokens": 2},
            headers={"X-Kvscope-Replica": other},
        )
        assert continued.status_code == 200, continued.text
        assert continued.headers["x-kvscope-replica"] == owner
        usage = continued.json()["usage"]
        assert usage["input_tokens"] > stored["usage"]["input_tokens"]
        background = client.post(
            "/v1/responses",
            json={
                "input": "A story",
                "background": True,
                "max_output_tokens": 3000,
                "ignore_eos": True,
            },
        ).json()
        cancelled = client.post(f"/v1/responses/{background['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert client.delete(f"/v1/responses/{background['id']}").json()["deleted"] is True
        assert client.get(f"/v1/responses/{background['id']}").status_code == 404
    live.wait_clean()
