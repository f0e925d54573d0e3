"""Times the multiplies by GGML-quantized weights (`kvscope.kernels.quantized`) against
bfloat16 weights, on SmolLM2-135M's linear shapes, and prints a markdown table.

For each shape and row count: bfloat16 `F.linear` (oneDNN), the compiled bfloat16
`small_linear` at one row (what the float model's decode uses), the quantized
integer-dot kernel, the quantized dequantize-a-slab-then-`F.linear` path, which of the
two `quantized_linear` takes, and at one row the weight bytes each reads per second.
Run: `python -m kvscope.bench.quant_matmul [--threads N] [--qtype Q4_1]`.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Sequence
from functools import partial

import attrs
import torch
import torch.nn.functional as F

from kvscope.kernels.cpu_decode import cpu_kernel
from kvscope.kernels.ggml_quants import random_blocks
from kvscope.kernels.quantized import (
    DOT_ROWS,
    QuantizedWeight,
    dequantize,
    dot_linear,
    slab_linear,
)

#: (name, in_features, out_features, the type SmolLM2-135M-Instruct.Q4_1.gguf has)
SHAPES = (
    ("qkv", 576, 960, None),
    ("o_proj", 576, 576, None),
    ("gate_up", 576, 3072, None),
    ("down", 1536, 576, None),
    ("lm_head", 576, 49152, "Q8_0"),
)
ROWS = (1, 4, 8, 16, 32, 256)


def best_seconds(run: Callable[[], object], budget: float = 0.3, repeats: int = 5) -> float:
    """The quickest mean time of one call, over `repeats` batches of calls that each
    take about `budget / repeats` seconds (the machine is shared: the quickest batch
    is the least disturbed)."""
    run()
    started = time.perf_counter()
    run()
    once = max(time.perf_counter() - started, 1e-6)
    calls = max(1, int(budget / repeats / once))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def cycling(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One call after another of `calls`, round and round."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def bench_shape(name: str, k: int, n: int, qtype: str, cold_bytes: int) -> list[str]:
    """The table's lines for one weight shape. Each timed call takes the next of as many
    copies of the weight as `cold_bytes` of bfloat16 need (1 when 0), so that, as in a
    decode step through a whole model, the weights come from memory, not cache."""
    generator = torch.Generator().manual_seed(0)
    weight = QuantizedWeight(qtype, (n, k), random_blocks(qtype, n, k, generator))
    dense = dequantize(weight, torch.bfloat16)
    copies = max(1, -(-cold_bytes // (dense.numel() * 2)))
    weights = [weight] + [attrs.evolve(weight, data=weight.data.clone()) for _ in range(copies - 1)]
    denses = [dense] + [dense.clone() for _ in range(copies - 1)]
    small = cpu_kernel().small_linear_op
    lines = []
    for rows in ROWS:
        x = torch.randn(rows, k, generator=generator).bfloat16()
        bf16 = best_seconds(cycling([partial(F.linear, x, d) for d in denses]))
        dot = best_seconds(cycling([partial(dot_linear, x, w) for w in weights]))
        slabs = [partial(slab_linear, x, w, None, compiled=True) for w in weights]
        slab = best_seconds(cycling(slabs))
        small_ms, rates = "", ""
        if rows == 1 and small is not None:
            out = x.new_empty(1, n)
            small_s = best_seconds(cycling([partial(small, out, x, d, None) for d in denses]))
            small_ms = f"{small_s * 1e3:.3f}"
            bf16_rate = dense.numel() * 2 / min(bf16, small_s) / 1e9
            rates = f"{bf16_rate:.1f} / {weight.data.numel() / min(dot, slab) / 1e9:.1f}"
        chosen = "dot" if rows <= DOT_ROWS else "slab"
        speedup = bf16 / (dot if chosen == "dot" else slab)
        lines.append(
            f"| {name} {k}->{n} {qtype} | {rows} | {bf16 * 1e3:.3f} | {small_ms} | "
            f"{dot * 1e3:.3f} | {slab * 1e3:.3f} | {chosen} | {speedup:.2f}x | {rates} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--qtype", default="Q4_1", help="the type of the layers' weights")
    parser.add_argument(
        "--cold-mib",
        type=int,
        default=256,
        help="bfloat16 MiB of weight copies to cycle through (0: one copy, cache-hot)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = cpu_kernel()
    if not kernel.wait(timeout=900) or kernel.quant_linear_op is None:
        raise SystemExit(f"the compiled library is not here: {kernel.why_not}")
    print(
        f"{args.threads} threads, kernel ISA {kernel.isa}, {args.cold_mib} MiB of bf16 copies "
        "cycled; times in ms, the quickest batch"
    )
    print(
        "| weight | rows | bf16 F.linear | bf16 small_linear | quant dot | quant slab "
        "| chosen | vs F.linear | GB/s of weight at 1 row (bf16 / quant) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for name, k, n, qtype in SHAPES:
            for line in bench_shape(name, k, n, qtype or args.qtype, args.cold_mib << 20):
                print(line)


if __name__ == "__main__":
    main()
