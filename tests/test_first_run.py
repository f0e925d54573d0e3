"""The first run needs only the runtime dependencies: every module of kvscope that the
CLI can reach imports, and every subcommand's `--help` works, with the modules that
only the extras install made unimportable. (`.ci/run` also runs the README's first
command in a fresh venv; this catches the same class of break in the normal suite.)

The extras' modules are found from `pyproject.toml` and the installed distributions, so
a dependency added to an extra is blocked here without editing this test.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Subpackages and modules that belong to an extra and may import it.
EXTRA_ONLY = ("kvscope.bench", "kvscope.replicas", "kvscope.kernels.triton_attention")


def _dist_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def extra_only_modules() -> list[str]:
    """Top-level modules installed by an extra's distributions and by no runtime one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_dist_name(r) for r in project["dependencies"]}
    extras = {_dist_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    blocked = []
    for module, dists in importlib.metadata.packages_distributions().items():
        names = {d.lower().replace("_", "-") for d in dists}
        if names & extras and not names & runtime:
            blocked.append(module)
    return sorted(blocked)


SCRIPT = """
import importlib, pkgutil, sys, contextlib, io
BLOCKED = set(sys.argv[1].split(","))
EXTRA_ONLY = tuple(sys.argv[2].split(","))

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (an extra's module)")
        return None

sys.meta_path.insert(0, Blocker())
import kvscope
for info in pkgutil.walk_packages(kvscope.__path__, "kvscope."):
    if not info.name.startswith(EXTRA_ONLY):
        importlib.import_module(info.name)
from kvscope.cli import main
for argv in ([], ["serve"], ["generate"]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit as exit:
            assert exit.code == 0, (argv, exit.code)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(["bench", "throughput"])
assert code == 2, code
assert "pip install 'kvscope[bench]'" in err.getvalue(), err.getvalue()
print("ok")
"""


def test_cli_runs_without_the_extras() -> None:
    blocked = extra_only_modules()
    # The test is only meaningful if it blocks what the bench extra brings.
    assert "httpx" in blocked and "transformers" in blocked, blocked
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(blocked), ",".join(EXTRA_ONLY)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
