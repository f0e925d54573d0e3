"""Kernel tests. Without a CUDA device, Triton kernels run under Triton's interpreter:
`TRITON_INTERPRET=1` must be set before `triton` is first imported (its standard
library is built for the interpreter or the compiler at import), so it is set here,
when this directory is collected, unless a GPU is present or triton is already loaded.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
