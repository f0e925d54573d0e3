"""Fixtures for the server tests: the real app on hypercorn on 127.0.0.1, a free port.

`running_server(backend, ...)` runs `Server` in a blocking portal (its own thread and
event loop, asyncio or trio), yields a `Live` handle (base URL, audit log path, the
engine for end-of-test checks) and, on exit, shuts the server down gracefully and
asserts that no KV block and no request is left. Tests use real clients (httpx,
websockets, openai) from the test thread, and wait with deadlines, never sleeps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvscope.models.loader import BUNDLED_DIR
from kvscope.web.server import Server
from kvscope.web.settings import ServerSettings
from tests.conftest import assert_clean

#: The repository's root, where `kvscope serve` runs as a child.
ROOT = Path(__file__).resolve().parents[2]

BACKENDS = ["asyncio", "trio"]
#: A request that runs for a long time unless cancelled.
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


@attrs.define
class Live:
    server: Server
    portal: BlockingPortal
    url: str
    audit_path: Path

    def client(self, key: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://")

    def audit(self) -> dict[str, dict[str, Any]]:
        """The audit log's lines by request id."""
        if not self.audit_path.exists():
            return {}
        lines = self.audit_path.read_text().splitlines()
        return {record["id"]: record for record in map(json.loads, lines)}

    def audit_record(self, request_id: str) -> dict[str, Any]:
        """The request's audit line, once written (at the release of its blocks, which
        can come a step after its status reads final)."""
        return wait_for(
            lambda: self.audit().get(request_id), what=f"the audit line of {request_id}"
        )

    def stats(self) -> dict[str, Any]:
        assert self.server.engine is not None
        return self.portal.call(self.server.engine.stats)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@contextmanager
def running_server(
    backend: str, tmp_path: Path, *, api_keys: tuple[str, ...] = (), **options: Any
) -> Iterator[Live]:
    settings_fields = {f.name for f in attrs.fields(ServerSettings)}
    settings = ServerSettings(
        port=0,
        backend=backend,
        api_keys=list(api_keys),
        graceful_timeout=10,
        **{k: v for k, v in options.items() if k in settings_fields},
    )
    audit_path = tmp_path / f"audit-{backend}.jsonl"
    engine_kwargs = {
        "model": "tiny-random",
        "device": "cpu",
        "num_kv_blocks": 1024,
        "debug": True,
        "audit_log": str(audit_path),
        **{k: v for k, v in options.items() if k not in settings_fields},
    }
    server = Server(settings, engine_kwargs)
    with start_blocking_portal(backend) as portal:
        future, port = portal.start_task(server.run)
        try:
            yield Live(server, portal, f"http://127.0.0.1:{port}", audit_path)
        finally:
            portal.call(server.request_shutdown)
            future.result(timeout=60)
    assert server.engine is not None
    assert_clean(server.engine)


@pytest.fixture
def client(live: Live) -> Iterator[Any]:
    """The `openai` client on `live`'s OpenAI routes."""
    import openai

    with openai.OpenAI(
        base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30
    ) as opened:
        yield opened


@pytest.fixture
def live(backend: str, tmp_path: Path) -> Iterator[Live]:
    with running_server(backend, tmp_path) as running:
        yield running


def wait_for(
    predicate: Callable[[], Any], *, timeout: float = 20.0, what: str = "condition"
) -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def wait_status(
    client: httpx.Client,
    request_id: str,
    statuses: tuple[str, ...] = ("finished", "cancelled", "failed"),
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        info = client.get(f"/requests/{request_id}").json()
        return info if info["status"] in statuses else None

    return wait_for(check, what=f"{request_id} to reach {statuses}")


def wait_tokens(client: httpx.Client, request_id: str, n: int = 1) -> dict[str, Any]:
    """Wait until the request is running and has generated `n` tokens."""

    def check() -> dict[str, Any] | None:
        info = client.get(f"/requests/{request_id}").json()
        return info if info["tokens_generated"] >= n else None

    return wait_for(check, what=f"{request_id} to generate {n} token(s)")


def serve_cli(
    backend: str,
    *args: str,
    model: str | None = "tiny-random",
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """`kvscope serve` as a child process on `model` (None: the one `args` name) and a
    free port, with `args`; the process and its URL once it listens (its stdout's
    first line says where)."""
    chosen = ["--model", model] if model is not None else []
    process = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "serve", *chosen]
        + ["--device", "cpu", "--port", "0", "--backend", backend, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=preexec_fn,
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # blocks until the server printed where it listens
    match = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not match:
        process.kill()
        _, stderr = process.communicate(timeout=60)
        raise AssertionError(line + stderr)
    return process, match.group(0)


@contextmanager
def served(backend: str, *args: str, model: str | None = "tiny-random") -> Iterator[str]:
    """`serve_cli`'s server for the body of a `with`, its URL; then stopped by SIGTERM,
    which it must survive to exit 0 (killed instead where the body failed)."""
    process, url = serve_cli(backend, *args, model=model)
    try:
        yield url
        process.send_signal(signal.SIGTERM)
        _, log = process.communicate(timeout=60)  # drained: a full pipe would block it
        assert process.returncode == 0, log[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON objects (or `[DONE]`) of an SSE stream's `data:` lines."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def bundled_with_template(directory: Path, template: str) -> Path:
    """A copy of the bundled model under `directory` whose chat template is `template`
    (its name, and so the OpenAI routes' model id, is `model`)."""
    model = directory / "model"
    shutil.copytree(BUNDLED_DIR, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": template}))
    return model


def wait_clean(live: Live) -> dict[str, Any]:
    """Wait until no request is live and no KV block is in use."""

    def check() -> dict[str, Any] | None:
        stats = live.stats()
        return stats if stats["live_requests"] == 0 and stats["kv_blocks_in_use"] == 0 else None

    return wait_for(check, what="no live request and no block in use")


def alone(live: Live, prompt: str, max_tokens: int) -> list[int]:
    """The greedy tokens of `prompt` run on its own."""
    with live.client() as client:
        response = client.post(
            "/generate",
            json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        )
        assert response.status_code == 202
        return wait_status(client, response.json()["id"])["token_ids"]
