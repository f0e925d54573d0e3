"""Whether prefill chunks go through the compiled library's `paged_prefill` or SDPA.

The compiled library (`cpu_decode.py`) has `paged_prefill`: a prefill chunk's rows
attend over the blocks in place, a tile of rows at a time. Whether it or SDPA is quicker depends on the CPU
(SDPA's flash kernel multiplies on AMX tiles where there are some), so when the kernel
loads it is timed against SDPA (over the chunks' own rows, as fresh prompts attend:
`reference.sdpa_own_rows`) on one shape (`PREFILL_PROBE`), and prefill chunks go
through the kernel only where it won (`CpuKernel.prefill_in_place`). On the 2-core AMX
machine, 8 prompts of 256 tokens, one layer of the reference model: 2.7 ms for SDPA over
the own rows, 3.8 for gather + SDPA a chunk at a time, 5.0 for the kernel.
`KVSCOPE_PREFILL=kernel` or `=sdpa` skips the timing and says which serves.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from .reference import sdpa_own_rows

log = logging.getLogger(__name__)

#: The prefill timed against SDPA when the kernel loads: chunks of this many
#: tokens, from position 0, in the reference model's head layout (8 query heads over 4
#: KV heads of 64), bfloat16, blocks of 16.
PREFILL_PROBE = {"chunks": 4, "tokens": 256, "heads": 8, "kv_heads": 4, "dim": 64, "block": 16}
PREFILL_CHOICES = ("auto", "kernel", "sdpa")


def prefill_in_place(prefill_op: Callable[..., None]) -> bool:
    """Whether prefill chunks should go through `prefill_op`: as `KVSCOPE_PREFILL`
    says, or (auto) where it beats SDPA on `PREFILL_PROBE`; logged."""
    choice = os.environ.get("KVSCOPE_PREFILL", "auto")
    if choice not in PREFILL_CHOICES:
        log.warning("KVSCOPE_PREFILL=%s is not one of %s; taking auto", choice, PREFILL_CHOICES)
        choice = "auto"
    if choice != "auto":
        log.info("prefill attention: %s (KVSCOPE_PREFILL)", choice)
        return choice == "kernel"
    kernel_ms, sdpa_ms = (seconds * 1e3 for seconds in _time_prefill(prefill_op))
    wins = kernel_ms < sdpa_ms
    log.info(
        "prefill attention: %s (in-place kernel %.2f ms, SDPA %.2f ms on %d x %d tokens)",
        "in-place kernel" if wins else "SDPA",
        kernel_ms,
        sdpa_ms,
        PREFILL_PROBE["chunks"],
        PREFILL_PROBE["tokens"],
    )
    return wins


def _time_prefill(prefill_op: Callable[..., None]) -> tuple[float, float]:
    """The quickest of a few runs of `prefill_op` and of SDPA on the probe."""
    shape = PREFILL_PROBE
    chunks, tokens, block = shape["chunks"], shape["tokens"], shape["block"]
    width = -(-tokens // block)
    generator = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(torch.bfloat16)

    # Block-major, as `KVCache` stores it wherever this library serves.
    keys = rand(chunks * width, block, shape["kv_heads"], shape["dim"])
    values = rand(chunks * width, block, shape["kv_heads"], shape["dim"])
    tables = torch.arange(chunks * width).view(chunks, width)
    query = rand(chunks * tokens, shape["heads"], shape["dim"])
    own_keys = rand(chunks * tokens, shape["kv_heads"], shape["dim"])
    own_values = rand(chunks * tokens, shape["kv_heads"], shape["dim"])
    out = torch.empty_like(query)
    starts = torch.zeros(chunks, dtype=torch.int32)
    offsets = torch.arange(0, (chunks + 1) * tokens, tokens, dtype=torch.int32)

    def kernel() -> None:
        prefill_op(out, query, keys, values, tables, starts, offsets, 0.125)

    def sdpa() -> None:
        out[:] = sdpa_own_rows(query, own_keys, own_values, chunks, 0.125)

    def quickest(run: Callable[[], None]) -> float:
        run()  # warm-up
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - started)
        return best

    with torch.inference_mode():
        return quickest(kernel), quickest(sdpa)
