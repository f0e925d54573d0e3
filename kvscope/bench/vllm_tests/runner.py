"""One run of vLLM's test files against one server (docs/vllm-tests.md, "How it runs").

pytest runs in vLLM's virtualenv (the tests import vLLM), in the extracted sdist, with
`pytest_plugin` loaded under the name `PLUGIN_MODULE` and its settings in its
environment variable; its JUnit XML gives each test's outcome, and the plugin's launch
file each server it started. The kvscope server is this kvscope: `python -m kvscope.cli
serve` with this interpreter and this source tree on its path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import attrs

from . import pytest_plugin
from .results import Launch, ServerRun, read_junit

#: The name the plugin is copied under and loaded by (`pytest -p`).
PLUGIN_MODULE = "kvscope_vllm_plugin"

#: How long pytest has to stop its servers after a SIGTERM.
STOP_SECONDS = 60


@attrs.frozen
class Setup:
    """What every run shares: vLLM's python, the extracted sdist, the pytest arguments
    (the tests), the Hugging Face home the model names resolve in, the LoRA adapter,
    the model `kvscope serve` loads and flags it adds, the checkpoint vLLM serves (under the tests' names)
    and where the logs and the XML go."""

    vllm_python: Path
    root: Path
    tests: list[str]
    hf_home: Path
    lora_dir: Path
    kvscope_model: str
    kvscope_args: list[str]
    checkpoint: Path
    work: Path


def accepted_flags() -> dict[str, list[str] | None]:
    """Every option string `kvscope serve` takes, with the values it allows where it
    lists them (`--dtype`: auto, float32, bfloat16), else None."""
    from kvscope import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return {
        flag: None if action.choices is None else [str(c) for c in action.choices]
        for action in parser._actions
        for flag in action.option_strings
    }


def kvscope_source() -> Path:
    """The directory that holds the `kvscope` package this process runs."""
    import kvscope

    return Path(kvscope.__file__).resolve().parents[1]


def server_env(server: str) -> dict[str, str]:
    """What each server's process gets in its environment besides the test's: kvscope's
    source on the path; for vLLM, the KV cache and the allocator `bench throughput`
    gives it."""
    if server == "kvscope":
        return {"PYTHONPATH": str(kvscope_source())}
    from ..throughput.vllm_peer import VLLM_KV_SPACE_GIB, vllm_preload

    env = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_SPACE_GIB), "PYTHONPATH": ""}
    if preload := vllm_preload():
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def plugin_settings(setup: Setup, server: str, launches: Path) -> dict[str, object]:
    return {
        "server": server,
        "serve": [sys.executable, "-m", "kvscope.cli", "serve"],
        "kvscope_args": setup.kvscope_args,
        "kvscope_model": setup.kvscope_model,
        "accepted_flags": accepted_flags(),
        "lora_dir": str(setup.lora_dir),
        "env": server_env(server),
        "launches": str(launches),
    }


def pytest_env(setup: Setup, settings: dict[str, object], plugin_dir: Path) -> dict[str, str]:
    """The test process's environment: the plugin's settings, the Hugging Face home
    offline, the plugin and the sdist importable, vLLM's `vllm` command on PATH."""
    return {
        **os.environ,
        pytest_plugin.SETTINGS_ENV: json.dumps(settings),
        "HF_HOME": str(setup.hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(setup.root)]),
        "PATH": os.pathsep.join([str(setup.vllm_python.parent), os.environ.get("PATH", "")]),
    }


def wait_or_stop(process: subprocess.Popen[bytes], timeout: float) -> int:
    """The process's exit status, once it exits or, past `timeout`, once it is stopped:
    SIGTERM first, on which vLLM's test launcher stops the servers it started."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
    try:
        return process.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def run_server(setup: Setup, server: str, timeout: float) -> ServerRun:
    """Run the tests against `server` ("kvscope" or "vllm"); pytest's log is kept in
    `setup.work / f"{server}.log"`."""
    plugin_dir = setup.work / "plugin"
    plugin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pytest_plugin.__file__, plugin_dir / f"{PLUGIN_MODULE}.py")
    junit = setup.work / f"{server}.xml"
    launches = setup.work / f"{server}-launches.jsonl"
    for stale in (junit, launches):
        stale.unlink(missing_ok=True)
    settings = plugin_settings(setup, server, launches)
    argv = [str(setup.vllm_python), "-m", "pytest", "-p", PLUGIN_MODULE]
    argv += ["-p", "no:cacheprovider", "-q", "-rfE", f"--junitxml={junit}", *setup.tests]
    started = time.perf_counter()
    with (setup.work / f"{server}.log").open("wb") as log:
        process = subprocess.Popen(
            argv,
            cwd=setup.root,
            env=pytest_env(setup, settings, plugin_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        returncode = wait_or_stop(process, timeout)
    seconds = time.perf_counter() - started
    outcomes = read_junit(junit) if junit.exists() else {}
    lines = launches.read_text().splitlines() if launches.exists() else []
    model = setup.kvscope_model if server == "kvscope" else str(setup.checkpoint)
    return ServerRun(
        server=server,
        model=model,
        returncode=returncode,
        seconds=round(seconds, 1),
        launches=[Launch.from_dict(json.loads(line)) for line in lines],
        outcomes=outcomes,
    )
