"""The package's build backend: setuptools' own, asking for torch in the build
environment of a wheel (`pip install .`, `pip wheel .`) so that `setup.py` can compile
the CPU library's prebuilt variants against it, and not for an editable install, which
keeps the run-time build. `KVSCOPE_PREBUILT=0` skips the kernels (and torch) entirely.

Torch is pinned to the release the README installs: an unpinned torch in an isolated
build environment can pull a CUDA build of several GB, and a library built against one
torch loads only under that same torch (`kvscope/kernels/prebuilt.py`).
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403 (every other hook as setuptools has it)

#: The torch the prebuilt libraries are compiled against.
BUILD_TORCH = "torch==2.13.0"


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    requires = build_meta.get_requires_for_build_wheel(config_settings)
    if os.environ.get("KVSCOPE_PREBUILT", "1") == "0":
        return requires
    return [*requires, BUILD_TORCH]
