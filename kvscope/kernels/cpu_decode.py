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
reference (`cpu_checks.py`). Where no library fits and no compiler exists, or the build or the check
fails, one log line says so and the fallback stays. `CpuKernel.library` names the
library that serves (one log line too) and `CpuKernel.isa` its vector path (AVX-512
BF16, AVX-512, AVX2 or none).

`CpuDecode` is the decode function `attention_backend.decode_backend("cpu")` hands out: the
kernel when it is ready and supports the dtype, the fallback otherwise.

The same library has `paged_prefill`, which serves prefill chunks where it beats SDPA
here (`prefill_choice.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from . import prebuilt
from .cpu_checks import (
    DTYPES,
    check_decode,
    check_elementwise,
    check_prefill,
    check_rope_and_cache,
    check_small_linear,
)
from .ggml_quants import check_quant_ops
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
            check_decode(op)
            check_prefill(prefill_op)
            check_elementwise(silu_and_mul, rms_norm)
            check_rope_and_cache(rope_and_cache)
            check_small_linear(small_linear)
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
    try:
        ops = torch.ops.kvscope.quant_linear.default, torch.ops.kvscope.quant_dequantize.default
        check_quant_ops(*ops)
    except Exception as exc:  # a broken build of this source alone: torch dequantizes
        log.warning("quantized weights stay on the torch fallback: %s", exc)
        return None, None
    return ops


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
