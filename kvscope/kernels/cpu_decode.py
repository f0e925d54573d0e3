"""The compiled CPU library: the decode kernel (`csrc/paged_decode.cpp`), which attends
over the paged K/V blocks in place instead of gathering them first, the prefill kernel
beside it, the fused elementwise steps (`csrc/elementwise.cpp`, used by `fused.py`), and
the multiplies by GGML-quantized weights (`csrc/quant_matmul.cpp`, used by `quantized.py`).

It is built once per machine, the first time an engine runs on the CPU, into a cache
directory (`$KVSCOPE_KERNEL_CACHE`, else `$TORCH_EXTENSIONS_DIR/kvscope`, else
`~/.cache/kvscope/kernels`), by invoking the C++ compiler (`$CXX`, default `g++`)
directly on the sources with torch's headers and libraries: no build tool, no new
dependency. The build runs in a background thread, so the engine serves at once on the
torch fallback and switches to the kernel when it is ready; a cached build is loaded at
once. The shared library registers `torch.ops.kvscope.paged_decode` and is loaded with
`torch.ops.load_library`; before first use it is checked against the torch reference.
Where no compiler exists, or the build or the check fails, one log line says so and
the fallback stays. The build's vector path follows the CPU (`-march=native`: AVX-512
BF16, AVX-512, AVX2 or none); `CpuKernel.isa` and the log line name it.

`CpuDecode` is the decode function `attention.decode_backend("cpu")` hands out: the
kernel when it is ready and supports the dtype, the fallback otherwise.

The same library has `paged_prefill`: a prefill chunk's rows attend over the blocks in
place, a tile of rows at a time. Whether it or SDPA is quicker depends on the CPU
(SDPA's flash kernel multiplies on AMX tiles where there are some), so when the kernel
loads it is timed against SDPA (over the chunks' own rows, as fresh prompts attend:
`attention.sdpa_own_rows`) on one shape (`PREFILL_PROBE`), and prefill chunks go
through the kernel only where it won (`CpuKernel.prefill_in_place`). On the 2-core AMX
machine, 8 prompts of 256 tokens, one layer of the reference model: 2.7 ms for SDPA over
the own rows, 3.8 for gather + SDPA a chunk at a time, 5.0 for the kernel.
`KVSCOPE_PREFILL=kernel` or `=sdpa` skips the timing and says which serves.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: Compiled into one library; `simd.h` beside them is theirs too (the cache key reads
#: every file of `csrc`).
SOURCES = (CSRC / "paged_decode.cpp", CSRC / "elementwise.cpp", CSRC / "quant_matmul.cpp")
#: Flags beyond torch's include and library paths. `-march=native`: the build is for
#: this machine only, and its cache key includes the CPU's flags.
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=gnu++20", "-shared", "-fPIC")
DTYPES = (torch.float32, torch.bfloat16)
#: The relative error the start-up check allows against the torch reference.
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
#: The prefill timed against SDPA when the kernel loads: chunks of this many
#: tokens, from position 0, in the reference model's head layout (8 query heads over 4
#: KV heads of 64), bfloat16, blocks of 16.
PREFILL_PROBE = {"chunks": 4, "tokens": 256, "heads": 8, "kv_heads": 4, "dim": 64, "block": 16}
PREFILL_CHOICES = ("auto", "kernel", "sdpa")
#: Builds kept in the cache besides the one in use: other venvs (another torch, another
#: compiler) may share the cache, so a few recent ones stay; older ones are deleted.
KEEP_OTHER_BUILDS = 3
#: A build's private file while the compiler writes it (renamed once whole); one older
#: than `ABANDONED_AFTER` seconds was left by a process that exited mid-build.
BUILDING_PREFIX = "building-"
ABANDONED_AFTER = 3600.0

Fallback = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def cache_dir() -> Path:
    if explicit := os.environ.get("KVSCOPE_KERNEL_CACHE"):
        return Path(explicit)
    if torch_dir := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(torch_dir) / "kvscope"
    return Path.home() / ".cache" / "kvscope" / "kernels"


def compiler() -> str | None:
    """The C++ compiler's path, or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_command(cxx: str, sources: Sequence[Path], output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = str(Path(torch.__file__).parent / "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        *FLAGS,
        "-fopenmp",  # at::parallel_for's OpenMP backend; resolves to torch's own libgomp
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        *(str(source) for source in sources),
        "-o",
        str(output),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]


def library_path(cxx: str) -> Path:
    """Where the build for these sources, torch, compiler and CPU lives."""
    key = hashlib.sha256()
    for source in sorted(CSRC.iterdir()):
        if source.is_file():
            key.update(source.read_bytes())
    # SOURCES too: a build of fewer of csrc's files must not pass for one of all of them
    # (by name: the same sources installed elsewhere, another venv's, share the build)
    names = (source.name for source in SOURCES)
    for part in (torch.__version__, cxx, " ".join(FLAGS), _cpu_flags(), *names):
        key.update(part.encode())
    key.update(sys.version.encode())
    return cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"


class CpuKernel:
    """The build and load of the shared library, at most once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        #: The compiler while it runs, stopped if this process exits first.
        self._build_process: subprocess.Popen[str] | None = None
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

    @property
    def ready(self) -> bool:
        return self.op is not None

    def start(self) -> None:
        """Load the cached build now, or start building it in the background."""
        with self._lock:
            if self._started:
                return
            self._started = True
        cxx = compiler()
        if cxx is None:
            name = os.environ.get("CXX", "g++")
            self._give_up(f"no C++ compiler ({name} not found)")
            return
        path = library_path(cxx)
        if path.exists():
            self._load(path)
            return
        log.info(
            "building the CPU paged-attention kernel in the background (%s, about a minute) "
            "into %s; serving with the torch fallback meanwhile",
            Path(cxx).name,
            path.parent,
        )
        thread = threading.Thread(
            target=self._build, args=(cxx, path), name="kvscope-kernel-build", daemon=True
        )
        atexit.register(self._stop_build)
        thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the kernel is ready or given up; True when it is ready."""
        self.start()
        self._done.wait(timeout)
        return self.ready

    def _build(self, cxx: str, path: Path) -> None:
        started = time.perf_counter()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Build under a private name, then rename: concurrent builds never see half a file.
            fd, tmp = tempfile.mkstemp(prefix=BUILDING_PREFIX, suffix=".so", dir=path.parent)
            os.close(fd)
            # Its own process group, so that `_stop_build` stops the compiler's children too.
            with subprocess.Popen(
                build_command(cxx, SOURCES, Path(tmp)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            ) as build:
                self._build_process = build
                _, stderr = build.communicate()
            self._build_process = None
            if build.returncode != 0:
                os.unlink(tmp)
                tail = " | ".join(stderr.strip().splitlines()[-3:])
                self._give_up(f"the build failed ({tail})")
                return
            os.replace(tmp, path)
        except OSError as exc:
            self._give_up(f"the build failed ({exc})")
            return
        prune_builds(path)
        self._load(path, built_in=time.perf_counter() - started)

    def _stop_build(self) -> None:
        """(at exit) Stop a build still running: it would outlive this process, and its
        private file stays for `prune_builds` to find abandoned."""
        build = self._build_process
        if build is not None and build.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(build.pid, signal.SIGKILL)
            build.wait()

    def _load(self, path: Path, built_in: float | None = None) -> None:
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
        self.prefill_in_place = _prefill_in_place(prefill_op)
        self.silu_and_mul_op, self.rms_norm_op = silu_and_mul, rms_norm
        self.rope_and_cache_op = rope_and_cache
        self.small_linear_op = small_linear if isa == "avx512-bf16" else None
        self.quant_linear_op, self.quant_dequantize_op = _quant_ops()
        self.op, self.prefill_op, self.isa = op, prefill_op, isa
        with contextlib.suppress(OSError):
            os.utime(path)  # "recent" for `prune_builds` means recently used
        if built_in is not None:
            log.info(
                "CPU paged-attention kernel (%s) built in %.0f s; the decode uses it now",
                isa,
                built_in,
            )
        else:
            log.info("CPU paged-attention kernel (%s) loaded from %s", isa, path)
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


def _prefill_in_place(prefill_op: Callable[..., None]) -> bool:
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
    from .attention import sdpa_own_rows

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


def prune_builds(current: Path, keep: int = KEEP_OTHER_BUILDS) -> list[Path]:
    """Delete all but the `keep` most recent other builds next to `current` (each
    source or torch change makes a new one), and the private files of builds abandoned
    mid-way (their process exited while the compiler ran); returns what was deleted. A
    build in use by another process stays mapped in it after its file is gone."""
    builds = _by_age(p for p in current.parent.glob("paged_decode-*.so") if p != current)
    building = _by_age(current.parent.glob(f"{BUILDING_PREFIX}*.so"))
    abandoned_before = time.time() - ABANDONED_AFTER
    abandoned = [path for mtime, path in building if mtime < abandoned_before]
    deleted = []
    for old in [path for _mtime, path in builds[keep:]] + abandoned:
        try:
            old.unlink()
            deleted.append(old)
        except OSError:
            pass  # another process pruned it first
    if deleted:
        log.info("deleted %d old CPU kernel build(s) from %s", len(deleted), current.parent)
    return deleted


def _by_age(paths: Iterable[Path]) -> list[tuple[float, Path]]:
    """(mtime, path) of each of `paths` still there, the most recent first (another
    process may rename or delete one meanwhile: its build finished, or it pruned)."""
    dated = []
    for path in paths:
        try:
            dated.append((path.stat().st_mtime, path))
        except OSError:
            continue
    return sorted(dated, reverse=True)


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
    from kvscope.models.rope import apply_rotary

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
