"""The llama.cpp peer of `bench throughput`: `llama-server` on the same GGUF file.

llama.cpp's own server (its `tools/server`), built apart and given by `--llama-server
PATH` (default `$KVSCOPE_LLAMA_SERVER`), serves the GGUF file `kvscope serve` serves,
with the settings its server README gives for many streams on a CPU:

* `-np N` slots, N the largest concurrency, each with room for a prompt and its whole
  answer: `-c N × (prompt + max tokens + SLOT_HEADROOM)` (with `-np` given, the KV
  cache is split per slot, not unified, and a slot stops one token short of full);
* continuous batching, `-cb` (its default, named so the argv says it);
* `-t` the thread count (prompt processing takes the same: `-tb`'s default);
* flash attention left at its default, `auto` (on where the CPU backend has it);
  prompt caching at its default (the prompts share no prefix); no web UI.

Everything else is llama-server's default; the argv is recorded with the run. The
requests are the other servers': llama-server's `/v1/completions` takes the prompt as
token ids, `ignore_eos` and `stream_options.include_usage` as they are, so nothing is
adapted. Imported only when the peer runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import anyio
import attrs

from ..core.options import ints
from ..core.servers import Server, free_port
from ..core.workload import Workload
from .records import ServedRun
from .served import run_served

#: Where `--llama-server` defaults to.
LLAMA_SERVER_ENV = "KVSCOPE_LLAMA_SERVER"
#: Tokens of context a slot has beyond its prompt and answer (see the docstring).
SLOT_HEADROOM = 16


def llama_server_missing(path: str | None) -> str | None:
    """None if `path` is a llama-server that can be started, else why not."""
    if not path:
        return (
            f"llama.cpp's llama-server is not given (--llama-server PATH or ${LLAMA_SERVER_ENV}; "
            "build llama.cpp's tools/server)"
        )
    if not Path(path).is_file() or not os.access(path, os.X_OK):
        return f"{path} is not an executable llama-server"
    return None


def llama_server_version(path: str) -> str | None:
    """`llama-server --version`'s version (its line `version: 0.5.0-dev (build 1,
    commit 0c1e570)`, on stderr), or None."""
    try:
        probe = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (probe.stderr + probe.stdout).splitlines()
    versions = (line.partition(":")[2].strip() for line in lines if line.startswith("version:"))
    return next(versions, None)


def llama_server(
    path: str, model_file: Path, *, threads: int, slots: int, slot_tokens: int, log_path: Path
) -> Server:
    """llama-server on `model_file` with `slots` slots of `slot_tokens` tokens each."""
    port = free_port()
    argv = [path, "-m", str(model_file), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-np", str(slots), "-c", str(slots * (slot_tokens + SLOT_HEADROOM)), "-cb"]
    argv += ["-t", str(threads), "--no-webui"]
    # GET /health answers 503 while the model loads, 200 once it serves.
    return Server(argv, ready_path="/health", port=port, log_path=log_path, start_timeout=300)


def llama_cpp_phase(
    args: argparse.Namespace,
    model_file: Path | None,
    levels: list[tuple[int, Workload]],
    missing: dict[str, str],
    weights: str | None,
) -> tuple[list[ServedRun], str | None]:
    """llama-server at every thread count, and its version (None if it did not run)."""
    path = args.llama_server or os.environ.get(LLAMA_SERVER_ENV)
    why = llama_server_missing(path)
    if why is None and model_file is None:
        model = args.model or "the reference model"
        why = f"llama.cpp serves a GGUF file (--model FILE.gguf); {model} is none"
    version = llama_server_version(path) if why is None and path else None
    if why is None and version is None:
        why = f"{path} --version does not answer as llama-server does"
    if why is not None:
        missing["llama.cpp"] = why
        print(f"llama.cpp peer MISSING: {why}", flush=True)
        return [], None
    assert path is not None and model_file is not None
    runs = []
    slots = max(c for c, _ in levels)
    slot_tokens = max(len(p) for _, w in levels for p in w.prompts) + args.max_tokens
    for threads in ints(args.threads):
        log = args.log_dir / f"llama-server-{threads}.log"
        server = llama_server(
            path, model_file, threads=threads, slots=slots, slot_tokens=slot_tokens, log_path=log
        )
        print(f"llama.cpp llama-server, {threads} thread(s) ...", flush=True)
        try:
            run = anyio.run(
                run_served, server, None, levels, args.level_timeout, "llama.cpp", threads
            )
        except (RuntimeError, TimeoutError) as exc:
            missing[f"llama.cpp threads={threads}"] = f"{exc}; log: {server.log_path}"
            print(f"llama.cpp failed: {exc}\n{server.log_tail()}", flush=True)
            continue
        # Its lookup decoding takes flags of its own: it runs without speculation.
        speculative = None if args.speculative_config is None else False
        runs.append(attrs.evolve(run, weights=weights, speculative=speculative))
    return runs, version
