"""A rolling redeploy (SIGHUP: `serve.run` again, a new version) drains streams."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvscope[ray]'")


from .conftest import LONG, Cluster, read_events, wait_for  # noqa: E402


def test_a_rolling_redeploy_drains_streams(cluster: Cluster) -> None:
    """Streams in flight on the old replicas end with their last event (a short one
    finished, a long one cancelled with reason `shutdown` after the drain timeout);
    new requests go to the replicas still running; every old replica is replaced."""
    old = set(cluster.wait_replicas())
    reads: dict[tuple[str, str], dict[str, Any]] = {}
    threads = []
    bodies = {
        "long": {"prompt": "A long tale", "stream": True, **LONG},
        "short": {"prompt": "A short one", "stream": True, "max_tokens": 24, "ignore_eos": True},
    }
    clients = [cluster.client() for _ in range(2 * len(old))]
    try:
        for client, (replica, kind) in zip(
            clients, [(r, k) for r in sorted(old) for k in bodies], strict=True
        ):
            out = reads[(replica, kind)] = {}
            thread = threading.Thread(target=read_events, args=(client, bodies[kind], replica, out))
            thread.start()
            threads.append(thread)
        wait_for(lambda: all(out.get("events") for out in reads.values()), what="all streaming")
        started = time.monotonic()
        cluster.process.send_signal(signal.SIGHUP)
        with cluster.client() as client:
            # The first old replica that Serve stops routing to: it drains now.
            first = wait_for(lambda: _unrouted(client, old), timeout=120, what="a replica stopping")
            # A DELETE of its long stream reaches it all the same (its direct address)
            # and cancels at once, not when the drain ends.
            long_id = reads[(first, "long")]["events"][0]["id"]
            answer = client.delete(f"/requests/{long_id}")
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvscope-replica"] == first
            for _ in range(4):
                job = client.post("/v1/completions", json={"prompt": "New", "max_tokens": 2})
                assert job.status_code == 200, job.text
                assert job.headers["x-kvscope-replica"] != first
        for thread in threads:
            thread.join(timeout=180)
            assert not thread.is_alive()
    finally:
        for client in clients:
            client.close()
    took = time.monotonic() - started
    for (replica, kind), out in reads.items():
        assert "error" not in out, (replica, kind, out["error"])
        last = out["events"][-1]
        assert last["type"] == "done", (replica, kind, last)
        if kind == "short":
            assert last["status"] == "finished", last
        elif replica == first:
            assert (last["status"], last["cancel_reason"]) == ("cancelled", "user"), last
        else:
            assert (last["status"], last["cancel_reason"]) == ("cancelled", "shutdown"), last
    new = set(
        wait_for(
            lambda: (r := cluster.replicas()) and len(r) == len(old) and not old & set(r) and r,
            timeout=240,
            what="every replica replaced",
        )
    )
    assert not new & old, f"roll took {took:.1f} s"
    cluster.wait_clean()


def _unrouted(client: httpx.Client, replicas: set[str]) -> str | None:
    """One of `replicas` that Serve no longer routes to: a call naming it is answered
    by another replica."""
    for replica in sorted(replicas):
        answer = client.get("/stats", params={"replica": replica})
        if answer.status_code == 200 and answer.json().get("replica") != replica:
            return replica
    return None
