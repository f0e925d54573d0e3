"""Starting and stopping the servers the benchmarks talk to (`kvscope serve` here; the
vLLM peer's launcher lives with `bench throughput`, the only command that starts it).

Each runs as a child process on 127.0.0.1 with its output in a log file; `Server` is a
context manager that starts it, waits until it answers, and on the way out terminates
the process it started (and only that one), killing it if it does not exit in time;
`left_behind` then names the processes it had started that outlived it (a model worker
process, multiprocessing's resource tracker): none, where the server cleans up.

A server answers before it is fully up: `kvscope serve --worker process` serves its
first steps in its own process while the model worker loads (the cold start is timed
that way, as a user meets it), and `--worker thread` builds its row buckets while idle
(`execution/warm_up.py`), and a first start builds the compiled kernels in the background.
`Server.settled()` waits for the rest (`GET /ready`), so that a figure said to be the
process worker's is the process worker's, no warm-up step runs in a measured round, and
no round runs on a fallback; the time it took is reported as the time to ready.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import attrs

from kvscope.web.serve import SERVED_WORKER

from .http import wait_ready
from .records import Record
from .workload import Deadline

#: vLLM's python (its own virtualenv, never kvscope's): `bench throughput` starts its
#: server with it, `bench vllm-tests` runs vLLM's tests with it (docs/benchmarks/README.md).
DEFAULT_VLLM_PYTHON = os.environ.get("KVSCOPE_VLLM_PYTHON", "/root/vllm-venv/bin/python")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@attrs.frozen
class ServerSettings(Record):
    """How a server was started, for the JSON: its command and the environment it added."""

    argv: list[str]
    env: dict[str, str] = attrs.field(factory=dict)


class Server:
    def __init__(
        self,
        argv: list[str],
        *,
        ready_path: str,
        port: int,
        log_path: Path,
        env: dict[str, str] | None = None,
        start_timeout: float = 600,
        settle: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.argv = argv
        self.ready_path = ready_path
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        self._settle = settle
        self.process: subprocess.Popen[bytes] | None = None
        #: perf_counter() when the process was spawned and when it first answered.
        self.spawned_at: float | None = None
        self.ready_at: float | None = None
        #: The server's children still there after it exited (set by `stop`).
        self.left_behind: list[int] = []
        self.settings = ServerSettings(list(argv), dict(env or {}))

    async def __aenter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.spawned_at = time.perf_counter()
        self.process = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        log.close()
        try:
            await wait_ready(
                self.base_url,
                self.ready_path,
                self.start_timeout,
                alive=lambda: self.process is not None and self.process.poll() is None,
            )
        except BaseException:
            self.stop()
            raise
        self.ready_at = time.perf_counter()
        return self

    async def settled(self) -> float | None:
        """Wait until the server is fully up (see the module's docstring); the seconds
        from spawning it, or None if it has nothing left to wait for."""
        if self._settle is None or self.spawned_at is None:
            return None
        await self._settle(self.base_url)
        return time.perf_counter() - self.spawned_at

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)

    def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        children = child_pids(self.process.pid)
        self.process.terminate()
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(timeout=10)
        deadline = Deadline(5)  # a child may still be on its way out
        while (left := [pid for pid in children if Path(f"/proc/{pid}").exists()]) and (
            not deadline.passed
        ):
            time.sleep(0.05)
        self.left_behind = left
        return code

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def last_core(pid: int) -> int | None:
    """The core `pid`'s main thread last ran on (field 39 of Linux's /proc stat; None
    elsewhere, or once it has ended)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; none elsewhere)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass  # it ended since the listing
    return children


def kvscope_server(
    model: str,
    *,
    threads: int,
    dtype: str,
    log_path: Path,
    audit_log: Path | None = None,
    worker: str = SERVED_WORKER,
    extra: list[str] | None = None,
) -> Server:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "kvscope.cli",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--model-threads",
        str(threads),
        "--log-level",
        "WARNING",
        "--worker",
        worker,
    ]
    if audit_log is not None:
        argv += ["--audit-log", str(audit_log)]
    return Server(
        argv + (extra or []),
        ready_path="/health",
        port=port,
        log_path=log_path,
        start_timeout=180,
        settle=wait_until_ready,
    )


async def wait_until_ready(base_url: str, timeout: float = 300) -> None:
    """Wait until `GET /ready` says the server serves at full speed: its kernel built,
    its model worker process up, its warm-up done (`actors/readiness.py`)."""
    await wait_ready(base_url, "/ready", timeout)
