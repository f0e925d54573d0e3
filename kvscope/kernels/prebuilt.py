"""The compiled CPU library as the package build ships it: one library per x86-64
instruction-set variant under `kernels/prebuilt/`, and the choice among them at run time.

`pip install .` and `pip wheel .` (see `setup.py`) compile `csrc/*.cpp` once per
variant of `VARIANTS` with `kernel_build.build_command` and a fixed `-march`, and write
`MANIFEST` beside the libraries: the torch version they were built against, a hash of
`csrc`, the source files, and the variants. At run time `choose` takes the best variant
whose CPU flags (/proc/cpuinfo) this machine has, provided the manifest's torch is the
one imported (a library built against another torch must not load) and its sources are
these; otherwise it says why, and the run-time build (`kernel_build.py`) serves instead.

Like `kernel_build`, this module imports nothing of kvscope's, for `setup.py`.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import kernel_build

PREBUILT_DIR = Path(__file__).with_name("prebuilt")
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Variant:
    """One instruction-set build: its name (the `isa` its library reports), its
    `-march` flags, and the /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    march: tuple[str, ...]
    needs: frozenset[str]


_V3 = frozenset("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split())
_V4 = _V3 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl".split())
#: Best first. The sources test `__AVX512BF16__` (`KVSCOPE_AVX512_BF16`, simd.h),
#: `__AVX512F__`, AVX2 with FMA (`KVSCOPE_SIMD`), F16C and `__AVX512VNNI__`.
VARIANTS = (
    Variant(
        "avx512-bf16",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
        _V4 | {"avx512_bf16", "avx512_vnni"},
    ),
    Variant("avx512", ("-march=x86-64-v4",), _V4),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
)


def library_name(variant: str) -> str:
    return f"kvscope-{variant}.so"


def choose(
    sources: Sequence[Path],
    directory: Path = PREBUILT_DIR,
    cpu_flags: Collection[str] | None = None,
    torch_version: str | None = None,
) -> tuple[Path, str] | str:
    """(library, variant) for the best prebuilt library in `directory` this CPU runs
    (`cpu_flags`, default this machine's) under this torch, else why none fits."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no prebuilt library in {directory} (a source tree or an editable install)"
    if manifest.get("machine") != platform.machine():
        return f"the prebuilt libraries are for {manifest.get('machine')}, not {platform.machine()}"
    if manifest.get("torch") != torch_version:
        return f"the prebuilt libraries are for torch {manifest.get('torch')}, not {torch_version}"
    if sorted(manifest.get("sources", ())) != sorted(s.name for s in sources):
        return "the prebuilt libraries were built from other source files"
    if manifest.get("digest") != kernel_build.sources_digest():
        return "the prebuilt libraries were built from other sources (csrc changed)"
    flags = set(cpu_flags if cpu_flags is not None else kernel_build.cpu_flags_line().split())
    built = set(manifest.get("variants", ()))
    for variant in VARIANTS:
        path = directory / library_name(variant.name)
        if variant.name in built and variant.needs <= flags and path.is_file():
            return path, variant.name
    return "no prebuilt variant runs on this CPU"


def build_all(cxx: str, directory: Path, jobs: int | None = None) -> list[str]:
    """Compile every variant of `csrc/*.cpp` into `directory` (some at once) and write
    the manifest; returns the variants built. Raises where a compile fails."""
    import subprocess

    import torch

    sources = sorted(kernel_build.CSRC.glob("*.cpp"))
    directory.mkdir(parents=True, exist_ok=True)

    def run(command: list[str]) -> None:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command[-8:])}: {result.stderr[-2000:]}")

    def compile_source(job: tuple[Variant, Path]) -> Path:
        variant, source = job
        obj = directory / f"{variant.name}-{source.stem}.o"
        command = kernel_build.build_command(cxx, [source], obj, march=variant.march)
        run([arg for arg in command if arg != "-shared"] + ["-c"])
        return obj

    # One compile a source and variant, as many at once as there are cores, then a link
    # a variant: the headers dominate, so this is what takes the time.
    jobs_list = [(variant, source) for variant in VARIANTS for source in sources]
    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_source, jobs_list))
    for variant in VARIANTS:
        mine = [obj for (v, _), obj in zip(jobs_list, objects, strict=True) if v is variant]
        run(
            kernel_build.build_command(
                cxx, mine, directory / library_name(variant.name), march=variant.march
            )
        )
        for obj in mine:
            obj.unlink()
    built = [variant.name for variant in VARIANTS]
    write_manifest(directory, sources, built, torch.__version__)
    return built


def write_manifest(
    directory: Path, sources: Sequence[Path], variants: Sequence[str], torch_version: str
) -> None:
    """Record beside the libraries what `choose` compares: torch, machine, sources."""
    manifest = {
        "torch": torch_version,
        "machine": platform.machine(),
        "digest": kernel_build.sources_digest(),
        "sources": [source.name for source in sources],
        "variants": list(variants),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
