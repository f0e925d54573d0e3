"""`kvscope bench vllm-tests`: vLLM's own OpenAI-entrypoint tests against `kvscope serve`
(and, with `--server vllm`, against `vllm serve` on the same SmolLM2 weights), a test a
row and a server a column (docs/vllm-tests.md).

It fetches vLLM's sdist (checked), unpacks its tests into the cache, makes the model
names the chosen files use resolve to SmolLM2's Hugging Face directory, writes the LoRA
adapter the LoRA fixtures get, and runs pytest with vLLM's python once a server.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..core import machine
from ..core.servers import DEFAULT_VLLM_PYTHON
from . import models, results, runner, sdist, selection
from .pytest_plugin import AS_NAMED

#: Where the sdist, its tests, the Hugging Face home, the adapter and the logs live.
CACHE = Path.home() / ".cache" / "kvscope" / "vllm-tests"

#: The SmolLM2 checkpoint written from the GGUF file unless `--hf-model` names one.
CONVERTED = CACHE / "smollm2-bf16"

SERVERS = ("kvscope", "vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server",
        action="append",
        choices=SERVERS,
        help="the server to run the tests against (repeatable; default kvscope); each "
        "gets a column",
    )
    p.add_argument(
        "--tests",
        nargs="+",
        metavar="FILE[::TEST]",
        help="test files below vLLM's tests/entrypoints/openai/ (default: every file "
        "docs/vllm-tests.md lists as run)",
    )
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=Path(DEFAULT_VLLM_PYTHON),
        help="the python of vLLM's virtualenv (default: $KVSCOPE_VLLM_PYTHON or "
        "/root/vllm-venv/bin/python)",
    )
    p.add_argument(
        "--model",
        default=AS_NAMED,
        help="what `kvscope serve` loads (default: the model each test names, which the "
        "harness's Hugging Face cache holds as SmolLM2's checkpoint, the one vLLM "
        "serves; smollm2: the Q4_1 GGUF file)",
    )
    p.add_argument(
        "--kvscope-args",
        default="",
        metavar="ARGS",
        help="more flags for every `kvscope serve` (one string, e.g. '--worker thread')",
    )
    p.add_argument(
        "--hf-model",
        type=Path,
        default=None,
        help="SmolLM2's Hugging Face directory: the tests' tokenizers and vLLM's weights "
        f"(default: {CONVERTED}, converted from the GGUF file once)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds a server's run")
    p.add_argument(
        "--logs",
        type=Path,
        default=CACHE / "runs",
        help="where pytest's log and JUnit XML go, a file each a server",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")


def checkpoint(given: Path | None) -> Path:
    if given is not None:
        return given
    if not (CONVERTED / "config.json").is_file():
        from ..convert import convert_gguf

        convert_gguf("smollm2", CONVERTED)
    return CONVERTED


def prepare(args: argparse.Namespace, python: Path) -> runner.Setup:
    """Fetch and unpack the tests, and write what they resolve their models to."""
    root = sdist.extract(sdist.fetch(CACHE), CACHE)
    tests = selection.select(root, args.tests)
    weights = checkpoint(args.hf_model)
    names = models.model_names(root / selection.file_of(test) for test in tests)
    home = models.hf_home(CACHE / "hf-home", names, weights)
    adapter = CACHE / "lora-smollm2"
    if not (adapter / "adapter_config.json").is_file():
        models.lora_adapter(adapter, weights)
    work = args.logs
    work.mkdir(parents=True, exist_ok=True)
    return runner.Setup(
        vllm_python=python,
        root=root,
        tests=tests,
        hf_home=home,
        lora_dir=adapter,
        kvscope_model=args.model,
        kvscope_args=shlex.split(args.kvscope_args),
        checkpoint=weights,
        work=work,
    )


def run(args: argparse.Namespace) -> int:
    if not args.vllm_python.exists():
        print(f"kvscope bench vllm-tests: no vLLM python at {args.vllm_python}", file=sys.stderr)
        return 2
    try:
        setup = prepare(args, args.vllm_python)
    except (ValueError, sdist.ChecksumError, OSError) as exc:
        print(f"kvscope bench vllm-tests: {exc}", file=sys.stderr)
        return 2
    unplaced = selection.unlisted(setup.root)
    if unplaced:
        print(f"files neither run nor skipped with a reason: {', '.join(unplaced)}")
    runs = []
    for server in args.server or ["kvscope"]:
        print(f"running {len(setup.tests)} test entries against {server} ...", flush=True)
        runs.append(runner.run_server(setup, server, args.timeout))
        print(f"  {server}: {results.counts(runs[-1].outcomes)} in {runs[-1].seconds} s")
        print(f"  log: {setup.work / f'{server}.log'}")
    print(results.table(runs))
    if args.json is not None:
        report = results.Report(sdist.VLLM_VERSION, setup.tests, machine.describe(), runs)
        report.to_json(args.json)
    return 0
