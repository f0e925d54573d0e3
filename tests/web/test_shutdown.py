"""SIGTERM on `kvscope serve` with streams in flight: every stream (SSE, OpenAI SSE,
WebSocket) ends with a final event, each request has its audit line with reason
`shutdown`, and the process exits 0. With `--worker thread`, and with no `--worker`,
which serves with a model worker process (the server's own copy of the model released
once it is ready), stopped and reaped on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from kvscope.bench.core.servers import child_pids
from kvscope.scheduling import LOOP_SLICE, current_slice
from tests.conftest import realtime_refusal, thread_policy

from .conftest import BACKENDS, LONG, serve_cli, sse_events, wait_for


class _Reader(threading.Thread):
    """Reads one stream to its end in a thread; `started` once a token arrived."""

    def __init__(self, kind: str, url: str) -> None:
        super().__init__(daemon=True)
        self.kind, self.url = kind, url
        self.started = threading.Event()
        self.events: list[Any] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.kind == "ws":
                self._websocket()
            else:
                self._sse()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.started.set()

    def _sse(self) -> None:
        path, body = (
            ("/generate", {"prompt": "sse", "stream": True, **LONG})
            if self.kind == "sse"
            else (
                "/v1/completions",
                {
                    "prompt": "oai",
                    "stream": True,
                    "max_tokens": 3000,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
        )
        with (
            httpx.Client(base_url=self.url, timeout=60) as client,
            client.stream("POST", path, json=body) as response,
        ):
            self.request_id = response.headers["x-request-id"]
            for event in sse_events(response.iter_lines()):
                self.events.append(event)
                self.started.set()

    def _websocket(self) -> None:
        with connect(self.url.replace("http://", "ws://") + "/ws/generate") as ws:
            ws.send(json.dumps({"prompt": "ws", **LONG}))
            for message in ws:
                event = json.loads(message)
                self.events.append(event)
                if event["type"] == "start":
                    self.request_id = event["id"]
                if event["type"] == "token":
                    self.started.set()


@pytest.mark.parametrize("worker", ["thread", None], ids=["thread", "default"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_with_streams_in_flight(backend: str, worker: str | None, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    args = ["--audit-log", str(audit), "--num-kv-blocks", "1024", "--debug"]
    process, url = serve_cli(backend, *args, *(["--worker", worker] if worker else []))
    try:
        worker_pid = _wait_for_worker(url) if worker is None else None
        _check_scheduling(process.pid, worker_pid)  # (idle: a busy loop may leave SCHED_FIFO)
        readers = [_Reader(kind, url) for kind in ("sse", "sse", "openai", "ws")]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.started.wait(60), reader.kind
            assert reader.error is None, reader.error
        children = child_pids(process.pid)
        assert worker_pid is None or worker_pid in children
        process.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(60)
            assert not reader.is_alive(), f"{reader.kind} stream did not end"
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    records = {r["id"]: r for r in map(json.loads, audit.read_text().splitlines())}
    for reader in readers:
        assert reader.error is None, (reader.kind, reader.error)
        if reader.kind == "openai":
            assert reader.events[-1] == "[DONE]"
            final = reader.events[-2]["choices"][0]
            assert final["finish_reason"] == "cancelled"
        else:
            final = reader.events[-1]
            assert (
                final["type"] == "done"
                and final["status"] == "cancelled"
                and final["cancel_reason"] == "shutdown"
            )
        record = records[reader.request_id]
        assert record["finish_reason"] == "cancelled" and record["cancel_reason"] == "shutdown"
    assert "KV blocks still in use" not in stderr
    # Every child (the model worker, multiprocessing's resource tracker) was stopped and
    # reaped by the server: none is left, not even as a zombie.
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], children


def _check_scheduling(server_pid: int, worker_pid: int | None) -> None:
    """The server's event loop thread (its main thread) runs under SCHED_FIFO where this
    process may take it, on short scheduler slices where it may not;
    no other thread of the server runs real-time; every thread of the model worker
    process runs on the default slice (`kvscope.scheduling`)."""
    realtime = realtime_refusal() is None
    assert thread_policy(server_pid) == (os.SCHED_FIFO if realtime else os.SCHED_OTHER)
    others = [int(tid) for tid in os.listdir(f"/proc/{server_pid}/task")]
    assert os.SCHED_FIFO not in [thread_policy(tid) for tid in others if tid != server_pid]
    if current_slice() is None:
        return  # this kernel has no per-thread slices
    if not realtime:
        assert current_slice(server_pid) == LOOP_SLICE
    if worker_pid is not None:
        for tid in os.listdir(f"/proc/{worker_pid}/task"):
            assert thread_policy(int(tid)) in (os.SCHED_BATCH, None), tid
            assert current_slice(int(tid)) in (current_slice(), None), tid


def _wait_for_worker(url: str) -> int:
    """The model worker's pid, once it is ready (it serves in-process until then); the
    server's own copy of the model has released its weights by then."""
    pid = wait_for(
        lambda: httpx.get(url + "/stats").json()["worker_pid"],
        timeout=120,
        what="the model worker to start",
    )
    assert httpx.get(url + "/stats").json()["model_bytes"] == 0
    return int(pid)
