"""The attention backend for a device: which decode kernel serves (`decode_backend`) and
how the K/V cache is laid out for the kernels that will read it (`block_major_cache`).

The decode rows go through the compiled C++ kernel (`cpu_decode.py`, built in the
background on first use) for CPU tensors, the Triton kernel (`triton_attention.py`) for
CUDA tensors, torch_npu's fused attention (`npu.py`) for Ascend tensors, and
`reference.reference_decode` otherwise, or while the device's kernel is unavailable.
Setting `KVSCOPE_ATTENTION=reference` forces the reference everywhere. Triton is
imported lazily, on the first step on a CUDA device: it is an optional extra.
"""

from __future__ import annotations

import logging
import os
from functools import cache

import torch

from .cpu_decode import CpuDecode, library_expected
from .npu import NpuDecode
from .reference import DecodeFn, reference_decode

log = logging.getLogger(__name__)


def block_major_cache(device: torch.device) -> bool:
    """Whether the K/V cache on `device` is stored block-major ([blocks, slots, kv_heads,
    dim]) rather than head-major ([kv_heads, blocks, slots, dim]), for the kernels that
    will read it: block-major for Ascend's fused kernels, and on the CPU wherever the
    compiled library is expected, prebuilt or built here (its kernels take either; a
    step's scattered writes and the decode's block reads then touch one page for all
    of a slot's heads instead of one page per head: a decode step of 32 rows of the
    reference model ~12 % quicker, prefill the same); head-major for the torch reference, whose gather is one
    `index_select` per head there (block-major, 60 % slower), and for Triton."""
    if device.type == "npu":
        return True
    if device.type != "cpu" or os.environ.get("KVSCOPE_ATTENTION", "auto") == "reference":
        return False
    return library_expected()


@cache
def decode_backend(device_type: str) -> DecodeFn:
    """The decode kernel for tensors on `device_type` (resolved once per type)."""
    if os.environ.get("KVSCOPE_ATTENTION", "auto") == "reference":
        return reference_decode
    if device_type == "cuda":
        try:
            from .triton_attention import paged_decode
        except ImportError as exc:
            log.warning("Triton is unavailable (%s); CUDA decode uses the torch reference", exc)
            return reference_decode
        return paged_decode
    if device_type == "npu":
        return NpuDecode(fallback=reference_decode)
    if device_type == "cpu":
        return CpuDecode(fallback=reference_decode)
    return reference_decode
