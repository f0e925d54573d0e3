"""The compiled CPU decode kernel: `csrc/paged_decode.cpp`, which attends over the paged
K/V blocks in place instead of gathering them first.

It is built once per machine, the first time an engine runs on the CPU, into a cache
directory (`$KVSCOPE_KERNEL_CACHE`, else `$TORCH_EXTENSIONS_DIR/kvscope`, else
`~/.cache/kvscope/kernels`), by invoking the C++ compiler (`$CXX`, default `g++`)
directly on the source with torch's headers and libraries: no build tool, no new
dependency. The build runs in a background thread, so the engine serves at once on the
torch fallback and switches to the kernel when it is ready; a cached build is loaded at
once. The shared library registers `torch.ops.kvscope.paged_decode` and is loaded with
`torch.ops.load_library`; before first use it is checked against the torch reference.
Where no compiler exists, or the build or the check fails, one log line says so and
the fallback stays. The build's vector path follows the CPU (`-march=native`: AVX-512
BF16, AVX-512, AVX2 or none); `CpuKernel.isa` and the log line name it.

`CpuDecode` is the decode function `attention.decode_backend("cpu")` hands out: the
kernel when it is ready and supports the dtype, the fallback otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
#: Flags beyond torch's include and library paths. `-march=native`: the build is for
#: this machine only, and its cache key includes the CPU's flags.
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=gnu++20", "-shared", "-fPIC")
DTYPES = (torch.float32, torch.bfloat16)
#: The relative error the start-up check allows against the torch reference.
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
#: Builds kept in the cache besides the one in use: other venvs (another torch, another
#: compiler) may share the cache, so a few recent ones stay; older ones are deleted.
KEEP_OTHER_BUILDS = 3

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


def build_command(cxx: str, source: Path, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = str(Path(torch.__file__).parent / "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        *FLAGS,
        "-fopenmp",  # at::parallel_for's OpenMP backend; resolves to torch's own libgomp
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        str(source),
        "-o",
        str(output),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]


def library_path(cxx: str) -> Path:
    """Where the build for this source, torch, compiler and CPU lives."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__, cxx, " ".join(FLAGS), _cpu_flags()):
        key.update(part if isinstance(part, bytes) else part.encode())
    key.update(sys.version.encode())
    return cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"


class CpuKernel:
    """The build and load of the shared library, at most once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self.op: Callable[..., None] | None = None
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
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            result = subprocess.run(
                build_command(cxx, SOURCE, Path(tmp)), capture_output=True, text=True
            )
            if result.returncode != 0:
                os.unlink(tmp)
                tail = " | ".join(result.stderr.strip().splitlines()[-3:])
                self._give_up(f"the build failed ({tail})")
                return
            os.replace(tmp, path)
        except OSError as exc:
            self._give_up(f"the build failed ({exc})")
            return
        prune_builds(path)
        self._load(path, built_in=time.perf_counter() - started)

    def _load(self, path: Path, built_in: float | None = None) -> None:
        try:
            torch.ops.load_library(str(path))
            op = torch.ops.kvscope.paged_decode.default
            isa = str(torch.ops.kvscope.paged_decode_isa())
            _check(op)
        except Exception as exc:  # a stale or broken build: never let it serve
            self._give_up(f"the kernel at {path} did not load or check out ({exc})")
            return
        self.op, self.isa = op, isa
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


def prune_builds(current: Path, keep: int = KEEP_OTHER_BUILDS) -> list[Path]:
    """Delete all but the `keep` most recent other builds next to `current` (each
    source or torch change makes a new one); returns what was deleted. A build in use
    by another process stays mapped in it after its file is gone."""
    others = sorted(
        (p for p in current.parent.glob("paged_decode-*.so") if p != current),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    deleted = []
    for old in others[keep:]:
        try:
            old.unlink()
            deleted.append(old)
        except OSError:
            pass  # another process pruned it first
    if deleted:
        log.info("deleted %d old CPU kernel build(s) from %s", len(deleted), current.parent)
    return deleted


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
            error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            if not error <= CHECK_RTOL[dtype]:
                raise RuntimeError(f"{dtype} result off by {error:.1e} relative")


@cache
def cpu_kernel() -> CpuKernel:
    return CpuKernel()


class CpuDecode:
    """Decode attention on the CPU: the compiled kernel once ready, else `fallback`."""

    def __init__(self, fallback: Fallback) -> None:
        self.kernel = cpu_kernel()
        self.fallback = fallback
        self.kernel.start()

    def in_place(self, dtype: torch.dtype) -> bool:
        """Whether a call with `dtype` runs the compiled kernel, which reads the blocks
        in place (and so can take a prefill chunk one row per token), not the fallback."""
        return self.kernel.op is not None and dtype in DTYPES

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
        if op is None or query.dtype not in DTYPES:  # see `in_place`
            return self.fallback(query, key_cache, value_cache, block_tables, context_lens, scale)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        tables = block_tables.to(torch.long).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        op(out, query, key_cache, value_cache, tables, lens, scale)
        return out
