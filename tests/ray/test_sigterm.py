"""SIGTERM on `kvscope serve --replicas 2` with streams in flight, as a Kubernetes
rollout sends it: like the single server (tests/web/test_shutdown.py), every stream on
every replica ends with its last event (a short one finished, a long one cancelled
with reason `shutdown` after the drain), the command exits 0, and no process of its
group (Ray's included) is left.

The command runs in a cluster of its own (the session's serves the other tests)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import connect

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvscope[ray]'")

from kvscope.replicas.ids import REPLICA_HEADER  # noqa: E402

from .conftest import LONG, Cluster, launch, read_events, stop, wait_for  # noqa: E402

BODIES: dict[str, dict[str, Any]] = {
    "long": {"prompt": "A long tale", "stream": True, **LONG},
    "short": {"prompt": "A short one", "stream": True, "max_tokens": 24, "ignore_eos": True},
    "openai": {
        "prompt": "An OpenAI tale",
        "stream": True,
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
    },
    "ws": {"prompt": "A WebSocket tale", **LONG},
}


def test_sigterm_drains_every_replica_and_exits_0(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cluster = launch(tmp_path_factory)
    group = cluster.process.pid
    try:
        reads: dict[tuple[str, str], dict[str, Any]] = {}
        threads = []
        for replica in sorted(cluster.replicas()):
            for kind in BODIES:
                out = reads[(replica, kind)] = {}
                thread = threading.Thread(target=_read, args=(cluster, kind, replica, out))
                thread.start()
                threads.append(thread)
        wait_for(lambda: all(out.get("events") for out in reads.values()), what="all streaming")
        assert len(_group_members(group)) > 1  # Ray's processes are in the group
        cluster.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=180)
            assert not thread.is_alive(), "a stream did not end"
        returncode = cluster.process.wait(timeout=120)
        log = cluster.log_path.read_text()
        assert returncode == 0, log[-3000:]
        for (replica, kind), out in reads.items():
            assert "error" not in out, (replica, kind, out["error"], log[-3000:])
            _check_last_event(kind, out["events"])
        # Ray's processes were stopped by the command, not left to die with it: the
        # group is empty by the time it exited (a worker may take a moment to exit).
        try:
            wait_for(lambda: not _group_members(group), timeout=10, what="the group empty")
        except AssertionError:
            raise AssertionError(f"left behind: {_group_members(group)}") from None
    finally:
        stop(cluster)
        _kill_group(group)


def _read(cluster: Cluster, kind: str, replica: str, out: dict[str, Any]) -> None:
    """Read one stream of `kind` on `replica` to its end into `out["events"]`."""
    if kind in ("long", "short"):
        with cluster.client() as client:
            read_events(client, BODIES[kind], replica, out)
        return
    events: list[Any] = []
    out["events"] = events
    try:
        if kind == "ws":
            url = f"{cluster.ws_url}/ws/generate"
            with connect(url, additional_headers={REPLICA_HEADER: replica}) as ws:
                ws.send(json.dumps(BODIES[kind]))
                events.extend(json.loads(message) for message in ws)
            return
        with (
            cluster.client() as client,
            client.stream(
                "POST", "/v1/completions", json=BODIES[kind], headers={REPLICA_HEADER: replica}
            ) as stream,
        ):
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
    except Exception as exc:  # reported by the test
        out["error"] = exc


def _check_last_event(kind: str, events: list[Any]) -> None:
    """The single server's last events on SIGTERM (see tests/web/test_shutdown.py)."""
    if kind == "openai":
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == "cancelled", events[-3:]
        return
    last = events[-1]
    assert last["type"] == "done", (kind, last)
    if kind == "short":
        assert last["status"] == "finished", last
    else:
        assert (last["status"], last["cancel_reason"]) == ("cancelled", "shutdown"), last


def _group_members(group: int) -> list[str]:
    """Every process in process group `group` (zombies too), as `pid command`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:
                command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                members.append(f"{stat.parent.name} {fields[0]} {command.decode()[:80]}")
        except (OSError, IndexError, ValueError):
            pass  # it ended since the listing
    return members


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing left: the case the test expects
