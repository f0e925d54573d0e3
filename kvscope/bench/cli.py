"""`kvscope bench`: the subcommands `cancel`, `throughput`, `report`, `convert` and
`vllm-tests` (docs/benchmarks/README.md, "Running them"; docs/vllm-tests.md).

`cancel` and `throughput` print markdown tables, and write `--json PATH` and `--plot
PATH` when asked; `report` prints the tables of saved JSON files again; `convert` writes
a GGUF file as the Hugging Face directory vLLM serves (`--peer-model`); `vllm-tests`
runs vLLM's own OpenAI tests against `kvscope serve` and prints a table. The benchmarks
need the `bench` extra; without it `main` says what to install and exits 2 before
importing anything heavy. Each subcommand's modules (and the peers' launchers, inside
`throughput`) are imported only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules the benchmarks import that only the `bench` extra installs.
BENCH_MODULES = ("aiohttp", "transformers")
INSTALL_HINT = "pip install 'kvscope[bench]'"

#: subcommand -> (its module, relative to this package, and its help line)
COMMANDS = {
    "throughput": (".throughput.command", "output tokens/s vs transformers and vLLM"),
    "cancel": (".cancel.command", "cancel half of many streams; each hop of the cancel path"),
    "report": (".report", "print the tables of saved --json files again"),
    "convert": (".convert", "a GGUF file as a Hugging Face bf16 directory (for vLLM)"),
    "vllm-tests": (".vllm_tests.command", "vLLM's own OpenAI-entrypoint tests against kvscope"),
}


def missing_modules() -> list[str]:
    missing = []
    for name in BENCH_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: list[str]) -> int:
    missing = missing_modules()
    if missing:
        print(
            f"kvscope bench needs the bench extra ({', '.join(missing)} missing): {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    parser = argparse.ArgumentParser(prog="kvscope bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    chosen = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the chosen command's module is imported
            importlib.import_module(module, __package__).add_arguments(p)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvscope.requests").setLevel(logging.WARNING)  # one line per request
    return importlib.import_module(COMMANDS[args.bench][0], __package__).run(args)
