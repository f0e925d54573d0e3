"""The package build's one addition to setuptools' (the rest is in pyproject.toml):
compile the CPU library's instruction-set variants into `kvscope/kernels/prebuilt/` of a
wheel (`kvscope/kernels/prebuilt.py` says how they are chosen at run time).

Skipped with a warning, leaving the run-time build to serve, where torch or a C++
compiler is missing from the build environment, where the machine is not x86-64, where
the compile fails, for an editable install, and with `KVSCOPE_PREBUILT=0`.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
import types
import warnings
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _prebuilt_module() -> types.ModuleType:
    """`kvscope.kernels.prebuilt`, without running the package's `__init__` (whose
    dependencies the build environment lacks)."""
    for name, path in (
        ("kvscope", ROOT / "kvscope"),
        ("kvscope.kernels", ROOT / "kvscope" / "kernels"),
    ):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    return importlib.import_module("kvscope.kernels.prebuilt")


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode or os.environ.get("KVSCOPE_PREBUILT", "1") == "0":
            return
        target = Path(self.build_lib) / "kvscope" / "kernels" / "prebuilt"
        why_not = self._build_kernels(target)
        if why_not:
            shutil.rmtree(target, ignore_errors=True)
            warnings.warn(
                f"kvscope: no prebuilt CPU kernels in this build ({why_not}); "
                "they will be compiled at run time where a C++ compiler exists",
                stacklevel=1,
            )

    def _build_kernels(self, target: Path) -> str:
        if platform.machine() not in ("x86_64", "AMD64"):
            return f"variants are x86-64 only, this is {platform.machine()}"
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch is not in the build environment"
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if cxx is None:
            return "no C++ compiler"
        try:
            built = _prebuilt_module().build_all(cxx, target)
        except Exception as exc:  # a build problem must not fail the install
            return f"the compile failed: {exc}"
        print(f"kvscope: prebuilt CPU kernels {', '.join(built)} in {target}", file=sys.stderr)
        return ""


class BinaryDistribution(Distribution):
    """A wheel that carries compiled libraries is for one platform and Python."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryDistribution)
