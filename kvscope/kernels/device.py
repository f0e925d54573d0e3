"""Device selection: `auto` picks an Ascend NPU, else CUDA, else the CPU.

`torch_npu` is imported lazily, only when an NPU is asked for or probed, because it is
an optional extra.
"""

from __future__ import annotations

import importlib.util

import torch


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:
        return False


def select_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if npu_available():
            return torch.device("npu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    kind = name.split(":", 1)[0]
    if kind == "npu" and not npu_available():
        raise ValueError(f"device {name!r} asked for, but torch_npu or an Ascend device is missing")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but no CUDA device is available")
    if name not in ("cpu", "cuda", "npu") and not name.startswith(("cuda:", "npu:")):
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or npu")
    return torch.device(name)
