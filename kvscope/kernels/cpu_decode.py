"""The compiled CPU library: the decode kernel (`csrc/paged_decode.cpp`), which attends
over the paged K/V blocks in place instead of gathering them first, the prefill kernel
beside it, the fused elementwise steps (`csrc/elementwise.cpp`, used by `fused.py`), and
the multiplies by GGML-quantized weights (`csrc/quant_matmul.cpp`, used by `quantized.py`).

Which library serves: a wheel's prebuilt variant for this CPU and torch where there
is one (`prebuilt.py`), loaded at once; else a build of this machine's own
(`kernel_build.py`: `-march=native`, cached), loaded at once when cached, else made in a
background thread while the engine serves on the torch fallback, switching to the
kernel when it is ready. The library registers `torch.ops.kvscope.*` and is loaded with
`torch.ops.load_library`; before first use each op is checked against its torch
reference here. Where no library fits and no compiler exists, or the build or the check
fails, one log line says so and the fallback stays. `CpuKernel.library` names the
library that serves (one log line too) and `CpuKernel.isa` its vector path (AVX-512
BF16, AVX-512, AVX2 or none).

`CpuDecode` is the decode function `attention.decode_backend("cpu")` hands out: the
kernel when it is ready and supports the dtype, the fallback otherwise.

The same library has `paged_prefill`, which serves prefill chunks where it beats SDPA
here (`prefill_choice.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from . import prebuilt
from .kernel_build import (  # noqa: F401 (BUILDING_PREFIX, build_command, prune_builds: re-exported)
    BUILDING_PREFIX,
    CSRC,
    BackgroundBuild,
    build_command,
    compiler,
    library_path,
    prune_builds,
)
from .prefill_choice import prefill_in_place

log = logging.getLogger(__name__)

#: Compiled into one library; `simd.h` beside them is theirs too (the cache key reads
#: every file of `csrc`).
SOURCES = (
    CSRC / "paged_decode.cpp",
    CSRC / "elementwise.cpp",
    CSRC / "quant_matmul.cpp",
    CSRC / "decode_layer.cpp",
)
DTYPES = (torch.float32, torch.bfloat16)
#: The relative error the start-up check allows against the torch reference.
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
Fallback = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def library_expected() -> bool:
    """Whether this process is expected to serve on the compiled library: a prebuilt one
    fits this CPU and torch, or a compiler can build it."""
    return not isinstance(prebuilt.choose(SOURCES), str) or compiler() is not None


class CpuKernel:
    """The build and load of the shared library, at most once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self.op: Callable[..., None] | None = None
        self.prefill_op: Callable[..., None] | None = None
        #: The fused elementwise steps (`csrc/elementwise.cpp`, used by `kernels/fused.py`).
        self.silu_and_mul_op: Callable[..., None] | None = None
        self.rms_norm_op: Callable[..., None] | None = None
        self.rope_and_cache_op: Callable[..., None] | None = None
        #: One or two bfloat16 rows times a weight (`kernels.linear.small_linear`); set
        #: only where the vector path has VDPBF16PS.
        self.small_linear_op: Callable[..., None] | None = None
        #: A few rows times a GGML-quantized weight, and its dequantization to slabs
        #: (`csrc/quant_matmul.cpp`, used by `kernels.quantized`).
        self.quant_linear_op: Callable[..., None] | None = None
        self.quant_dequantize_op: Callable[..., None] | None = None
        #: Whether prefill chunks go through `prefill_op` rather than SDPA.
        self.prefill_in_place = False
        self.why_not: str | None = None  # why the fallback serves, once known
        #: The instruction set the loaded build's vector path uses: "avx512-bf16",
        #: "avx512", "avx2" or "scalar" (`paged_decode_isa()` in the source).
        self.isa: str | None = None
        #: Which library serves: "prebuilt <variant>" (the wheel's) or "built here".
        self.library: str | None = None

    @property
    def ready(self) -> bool:
        return self.op is not None

    def start(self) -> None:
        """Load a prebuilt library or the cached build now, or start building it in the
        background."""
        with self._lock:
            if self._started:
                return
            self._started = True
        chosen = prebuilt.choose(SOURCES)
        if not isinstance(chosen, str):
            # (no build after it, should it fail its check: its ops are registered now)
            self._load(chosen[0], f"prebuilt {chosen[1]}")
            return
        log.info("no prebuilt CPU kernel library fits: %s", chosen)
        cxx = compiler()
        if cxx is None:
            name = os.environ.get("CXX", "g++")
            self._give_up(f"no C++ compiler ({name} not found)")
            return
        path = library_path(cxx, SOURCES)
        if path.exists():
            self._load(path, "built here")
            return
        log.info(
            "building the CPU paged-attention kernel in the background (%s, about a minute) "
            "into %s; serving with the torch fallback meanwhile",
            Path(cxx).name,
            path.parent,
        )
        build = BackgroundBuild(cxx, SOURCES)
        thread = threading.Thread(target=self._build, args=(build,), name="kvscope-kernel-build")
        thread.daemon = True
        thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the kernel is ready or given up; True when it is ready."""
        self.start()
        self._done.wait(timeout)
        return self.ready

    def _build(self, build: BackgroundBuild) -> None:
        why_not, seconds = build.run()
        if why_not:
            self._give_up(why_not)
        else:
            self._load(build.path, "built here", built_in=seconds)

    def _load(self, path: Path, library: str, built_in: float | None = None) -> None:
        try:
            torch.ops.load_library(str(path))
            op = torch.ops.kvscope.paged_decode.default
            prefill_op = torch.ops.kvscope.paged_prefill.default
            silu_and_mul = torch.ops.kvscope.silu_and_mul.default
            rms_norm = torch.ops.kvscope.rms_norm.default
            rope_and_cache = torch.ops.kvscope.rope_and_cache.default
            small_linear = torch.ops.kvscope.small_linear.default
            isa = str(torch.ops.kvscope.paged_decode_isa())
            _check(op)
            _check_prefill(prefill_op)
            _check_elementwise(silu_and_mul, rms_norm)
            _check_rope_and_cache(rope_and_cache)
            _check_small_linear(small_linear)
        except Exception as exc:  # a stale or broken build: never let it serve
            self._give_up(f"the kernel at {path} did not load or check out ({exc})")
            return
        self.prefill_in_place = prefill_in_place(prefill_op)
        self.silu_and_mul_op, self.rms_norm_op = silu_and_mul, rms_norm
        self.rope_and_cache_op = rope_and_cache
        self.small_linear_op = small_linear if isa == "avx512-bf16" else None
        self.quant_linear_op, self.quant_dequantize_op = _quant_ops()
        self.op, self.prefill_op, self.isa, self.library = op, prefill_op, isa, library
        with contextlib.suppress(OSError):
            if library == "built here":
                os.utime(path)  # "recent" for `prune_builds` means recently used
        if built_in is not None:
            log.info(
                "CPU paged-attention kernel (%s) built in %.0f s; the decode uses it now",
                isa,
                built_in,
            )
        else:
            log.info("CPU paged-attention kernel (%s, %s) loaded from %s", isa, library, path)
        self._done.set()

    def _give_up(self, why: str) -> None:
        self.why_not = why
        log.warning("CPU paged attention stays on the torch fallback: %s", why)
        self._done.set()


def _quant_ops() -> tuple[Callable[..., None], Callable[..., None]] | tuple[None, None]:
    """The quantized-weight ops (`csrc/quant_matmul.cpp`) once checked against their
    torch reference, else (None, None) and one log line: the rest of the library serves."""
    from .ggml_quants import check_quant_ops

    try:
        ops = torch.ops.kvscope.quant_linear.default, torch.ops.kvscope.quant_dequantize.default
        check_quant_ops(*ops)
    except Exception as exc:  # a broken build of this source alone: torch dequantizes
        log.warning("quantized weights stay on the torch fallback: %s", exc)
        return None, None
    return ops


def _check(op: Callable[..., None]) -> None:
    """Raise unless `op` agrees with the torch reference on a small ragged GQA batch
    and on one sequence long enough to be cut into spans. The head size, 32, takes
    every vector path there is (AVX-512 BF16's dot products need a multiple of 32)."""
    from .attention import reference_decode

    generator = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, dim = 4, 2, 4, 32
    ragged = torch.tensor([1, 7, 12], dtype=torch.int32), 3
    long = torch.tensor([300], dtype=torch.int32), 75
    for dtype in DTYPES:
        for lens, width in (ragged, long):
            batch = len(lens)
            blocks = batch * width + 1

            def rand(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.randn(*shape, generator=generator).to(dtype)

            keys = rand(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
            values = rand(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
            order = torch.randperm(blocks, generator=generator)
            tables = order[: batch * width].view(batch, width).contiguous()
            query = rand(batch, heads, dim)
            out = torch.empty_like(query)
            op(out, query, keys, values, tables, lens, dim**-0.5)
            ref = reference_decode(query, keys, values, tables, lens, dim**-0.5)
            _require_close(out, ref, f"{dtype} result")


def _check_prefill(op: Callable[..., None]) -> None:
    """Raise unless the prefill `op` agrees with the decode reference taking each row on
    its own (the chunk's blocks, its causal length): a first chunk, a later one that
    starts inside a block, and a one-row chunk, with GQA and a block size of 4."""
    from .attention import reference_decode

    generator = torch.Generator().manual_seed(1)
    block_size, kv_heads, heads, dim = 4, 2, 4, 32
    starts, lengths = [0, 6, 13], [9, 7, 1]
    width = max(-(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True))
    for dtype in DTYPES:

        def rand(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(dtype)

        blocks = len(starts) * width + 1
        keys = rand(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
        values = rand(kv_heads, blocks, block_size, dim).permute(1, 2, 0, 3)
        tables = torch.randperm(blocks, generator=generator)[: len(starts) * width]
        tables = tables.view(len(starts), width).contiguous()
        query = rand(sum(lengths), heads, dim)
        out = torch.empty_like(query)
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        op(out, query, keys, values, tables, torch.tensor(starts, dtype=torch.int32), offsets, 0.2)
        row_tables = tables.repeat_interleave(torch.tensor(lengths), dim=0)
        row_lens = torch.cat(
            [torch.arange(s + 1, s + n + 1) for s, n in zip(starts, lengths, strict=True)]
        ).to(torch.int32)
        ref = reference_decode(query, keys, values, row_tables, row_lens, 0.2)
        _require_close(out, ref, f"{dtype} prefill result")


def _check_elementwise(silu_and_mul: Callable[..., None], rms_norm: Callable[..., None]) -> None:
    """Raise unless the fused ops agree with torch's unfused ones (rows of a width the
    vector path does not divide, so its tail loop runs too)."""
    from .fused import torch_rms_norm, torch_silu_and_mul

    generator = torch.Generator().manual_seed(2)
    for dtype in DTYPES:
        x = (3 * torch.randn(5, 74, generator=generator)).to(dtype)
        weight = (torch.rand(74, generator=generator) + 0.5).to(dtype)
        activated, normed = x.new_empty(5, 37), torch.empty_like(x)
        silu_and_mul(activated, x)
        rms_norm(normed, x, weight, 1e-6)
        _require_close(activated, torch_silu_and_mul(x), f"{dtype} silu_and_mul")
        _require_close(normed, torch_rms_norm(x, weight, 1e-6), f"{dtype} rms_norm")


def _check_small_linear(small_linear: Callable[..., None]) -> None:
    """Raise unless `small_linear` agrees with `F.linear` in bfloat16 (one and two rows,
    a width the vector path takes and one it does not, with and without a bias)."""
    generator = torch.Generator().manual_seed(4)
    for rows, k, biased in ((1, 64, False), (2, 64, True), (2, 40, True)):
        x = torch.randn(rows, k, generator=generator).bfloat16()
        weight = torch.randn(70, k, generator=generator).bfloat16()
        bias = torch.randn(70, generator=generator).bfloat16() if biased else None
        out = x.new_empty(rows, 70)
        small_linear(out, x, weight, bias)
        _require_close(out, torch.nn.functional.linear(x, weight, bias), "small_linear")


def _check_rope_and_cache(rope_and_cache: Callable[..., None]) -> None:
    """Raise unless the fused rotary embedding and cache write agree with
    `apply_rotary` and `write_slots` (a head dim the vector path does not divide)."""
    from kvscope.kernels.rope import apply_rotary

    from .attention import write_slots

    generator = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        tokens, heads, kv_heads, dim = 5, 3, 1, 20
        qk = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
        v = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
        angles = torch.rand(tokens, dim // 2, generator=generator) * 6
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
        slots = torch.tensor([9, 0, 17, 4, 30])
        caches = [torch.zeros(kv_heads, 4, 8, dim, dtype=dtype).permute(1, 2, 0, 3) for _ in "kvKV"]
        rotated = qk.clone()
        rope_and_cache(rotated, v, cos, sin, slots, caches[0], caches[1])
        expected = apply_rotary(qk, cos, sin)
        write_slots(caches[2], slots, expected[:, heads - kv_heads :])
        write_slots(caches[3], slots, v)
        _require_close(rotated, expected, f"{dtype} rope_and_cache")
        _require_close(caches[0], caches[2], f"{dtype} rope_and_cache keys")
        _require_close(caches[1], caches[3], f"{dtype} rope_and_cache values")


def _require_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Raise unless `out` is within `CHECK_RTOL` of `ref`, relative to its largest value."""
    error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if not error <= CHECK_RTOL[out.dtype]:
        raise RuntimeError(f"{what} off by {error:.1e} relative")


@cache
def cpu_kernel() -> CpuKernel:
    return CpuKernel()


class CpuDecode:
    """Decode attention on the CPU: the compiled kernel once ready, else `fallback`."""

    def __init__(self, fallback: Fallback) -> None:
        self.kernel = cpu_kernel()
        self.fallback = fallback
        self.kernel.start()

    def prefills_in_place(self, dtype: torch.dtype) -> bool:
        """Whether prefill chunks of `dtype` go through `prefill` (the compiled kernel,
        where it loaded and beat SDPA here) rather than SDPA."""
        return (
            self.kernel.prefill_in_place and self.kernel.prefill_op is not None and dtype in DTYPES
        )

    def prefill(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        starts: torch.Tensor,
        offsets: torch.Tensor,
        scale: float,
    ) -> None:
        """Chunks' rows (`offsets` [chunks + 1] into `query`), each chunk's first token
        at position `starts[c]`, attend causally over their blocks, into `out`."""
        assert self.kernel.prefill_op is not None, "see prefills_in_place"
        self.kernel.prefill_op(
            out, query, key_cache, value_cache, block_tables, starts, offsets, scale
        )

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        op = self.kernel.op
        if op is None or query.dtype not in DTYPES:
            return self.fallback(query, key_cache, value_cache, block_tables, context_lens, scale)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        tables = block_tables.to(torch.long).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        op(out, query, key_cache, value_cache, tables, lens, scale)
        return out
