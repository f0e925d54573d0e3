"""A replica killed mid-stream: only its streams fail, Serve restarts it."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvscope[ray]'")

from kvscope.replicas.ids import owner_of  # noqa: E402

from .conftest import LONG, Cluster, read_events, wait_for  # noqa: E402


def test_killing_a_replica_fails_only_its_streams(cluster: Cluster) -> None:
    replicas = cluster.wait_replicas()
    victim, survivor = sorted(replicas)
    doomed: dict[str, Any] = {}
    spared: dict[str, Any] = {}
    with cluster.client() as a, cluster.client() as b:
        threads = [
            threading.Thread(
                target=read_events,
                args=(a, {"prompt": "Doomed", "stream": True, **LONG}, victim, doomed),
            ),
            threading.Thread(
                target=read_events,
                args=(
                    b,
                    {"prompt": "Spared", "stream": True, "max_tokens": 60, "ignore_eos": True},
                    survivor,
                    spared,
                ),
            ),
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: doomed.get("events") and spared.get("events"), what="both streaming")
        doomed_id = doomed["events"][0]["id"]
        assert owner_of(doomed_id) == victim
        os.kill(replicas[victim]["pid"], signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=120)
            assert not thread.is_alive()
    # The victim's stream ended with an error event naming it; the survivor's finished whole.
    assert "error" not in doomed, doomed.get("error")
    last = doomed["events"][-1]
    assert last["type"] == "error" and last["id"] == doomed_id, last
    assert f"replica {victim}" in last["error"]["message"]
    assert spared["events"][-1]["type"] == "done"
    assert spared["events"][-1]["status"] == "finished", spared["events"][-1]
    with cluster.client() as client:
        answer = client.get(f"/requests/{doomed_id}")
        assert answer.status_code == 404
        assert f"replica {victim}" in answer.json()["error"]["message"]
        assert client.delete(f"/requests/{doomed_id}").status_code == 404
    # Serve starts a new replica (a new name) in the victim's place.
    restarted = wait_for(
        lambda: (r := cluster.replicas()) and len(r) == 2 and victim not in r and r,
        timeout=240,
        what="Serve to restart the killed replica",
    )
    assert survivor in restarted
    cluster.wait_clean()
