"""Kernel tests. The `cpu_library` fixture is the compiled CPU library, built (or
loaded from the cache) once per session; its tests skip where no C++ compiler exists.

Without a CUDA device, Triton kernels run under Triton's interpreter:
`TRITON_INTERPRET=1` must be set before `triton` is first imported (its standard
library is built for the interpreter or the compiler at import), so it is set here,
when this directory is collected, unless a GPU is present or triton is already loaded.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kvscope.kernels import attention
from kvscope.kernels.cpu_decode import CpuKernel, compiler, cpu_kernel
from kvscope.kernels.slicing import LinearSlicer

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def cpu_library() -> CpuKernel:
    if compiler() is None:
        pytest.skip("no C++ compiler here: the engine serves on the torch fallback")
    kernel = cpu_kernel()
    assert kernel.wait(timeout=900), kernel.why_not
    return kernel


def attend_in_pieces(*args: object) -> tuple[torch.Tensor, int]:
    """`attention.paged_attention(*args)` with its prefill in the most pieces the
    slicer cuts (a first call times one piece on each path), and how many checkpoints
    the second call made."""
    slicer, between = LinearSlicer(target=1e-12), []
    for _learn_then_cut in range(2):
        between.clear()
        out = attention.paged_attention(
            *args,  # type: ignore[arg-type]
            slicing=slicer.attention,
            between=lambda: between.append(None),
        )
    return out, len(between)
