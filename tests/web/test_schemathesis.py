"""Property-based tests of every documented route against /openapi.json (schemathesis).

Runs schemathesis' own runner (`python -m schemathesis.cli run`) against the real
server, with bounded examples per operation and deterministic generation. Checks: no
5xx, responses match their documented schemas, and bodies the schema forbids are
refused. The server's context is short (`max_model_len=64`) so the jobs that generated
inputs start stay small. The run starts once `GET /ready` says the server is at full
speed: before, that route answers its documented 503 (warming), which the no-5xx check
would count. (schemathesis' pytest plugin is not used: its lazy-fixture
loader does not work with pytest 9.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import running_server, wait_clean, wait_for

pytest.importorskip("schemathesis")

CHECKS = "not_a_server_error,response_schema_conformance,negative_data_rejection"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_openapi_conformance(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path, max_model_len=64) as live:
        ready = lambda: httpx.get(live.url + "/ready").status_code == 200  # noqa: E731
        wait_for(ready, timeout=180, what="the server to be ready")
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                live.url + "/openapi.json",
                "--checks",
                CHECKS,
                "--max-examples",
                "20",
                "--generation-deterministic",
                "--request-timeout",
                "30",
                "--no-color",
                "--report-dir",
                str(tmp_path / "report"),
            ],
            capture_output=True,
            text=True,
            timeout=280,
        )
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        wait_clean(live)
