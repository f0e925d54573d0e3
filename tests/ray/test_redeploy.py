"""A rolling redeploy (SIGHUP: `serve.run` again, a new version) drains streams."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

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
        # The first old replica that Serve stops ends its long stream after the drain.
        first = wait_for(
            lambda: next((r for (r, k), o in reads.items() if k == "long" and _ended(o)), None),
            timeout=120,
            what="a long stream ended by the redeploy",
        )
        with cluster.client() as client:
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


def _ended(out: dict[str, Any]) -> bool:
    events = out.get("events") or []
    return bool(events) and events[-1]["type"] in ("done", "error")
