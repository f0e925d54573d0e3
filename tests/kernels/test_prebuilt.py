"""Which prebuilt CPU library (`kernels/prebuilt.py`) a machine takes: the best variant
its CPU flags allow, and none where the torch, the sources or the machine differ from
those the libraries were built for (the run-time build serves then). Runs in seconds:
the choice reads the manifest and the CPU flags, and loads nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvscope.kernels import prebuilt
from kvscope.kernels.cpu_decode import SOURCES
from kvscope.kernels.kernel_build import CSRC

AVX2 = "fpu sse4_2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split()
AVX512 = [*AVX2, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]
AVX512_BF16 = [*AVX512, "avx512_bf16", "avx512_vnni"]
ALL = [variant.name for variant in prebuilt.VARIANTS]


def shipped(directory: Path, variants=ALL, torch_version=torch.__version__, sources=SOURCES):
    """A directory as the package build leaves it, with (empty) libraries of `variants`."""
    for name in variants:
        (directory / prebuilt.library_name(name)).write_bytes(b"")
    prebuilt.write_manifest(directory, sources, variants, torch_version)
    return directory


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(AVX512_BF16, "avx512-bf16"), (AVX512, "avx512"), (AVX2, "avx2")],
)
def test_the_best_variant_the_cpu_runs_is_chosen(tmp_path, flags, expected) -> None:
    chosen = prebuilt.choose(SOURCES, shipped(tmp_path), cpu_flags=flags)
    assert chosen == (tmp_path / prebuilt.library_name(expected), expected)


def test_a_cpu_without_avx2_takes_none(tmp_path) -> None:
    flags = [f for f in AVX2 if f != "avx2"]
    why = prebuilt.choose(SOURCES, shipped(tmp_path), cpu_flags=flags)
    assert why == "no prebuilt variant runs on this CPU"


def test_a_variant_missing_from_the_directory_gives_way_to_the_next(tmp_path) -> None:
    directory = shipped(tmp_path, variants=["avx512", "avx2"])
    chosen = prebuilt.choose(SOURCES, directory, cpu_flags=AVX512_BF16)
    assert chosen == (directory / prebuilt.library_name("avx512"), "avx512")


def test_libraries_built_against_another_torch_are_refused(tmp_path) -> None:
    directory = shipped(tmp_path, torch_version="2.12.0+cpu")
    why = prebuilt.choose(SOURCES, directory, cpu_flags=AVX512_BF16)
    assert why == f"the prebuilt libraries are for torch 2.12.0+cpu, not {torch.__version__}"
    other = prebuilt.choose(SOURCES, shipped(tmp_path), AVX512_BF16, torch_version="2.14.1")
    assert isinstance(other, str) and "not 2.14.1" in other


def test_libraries_of_other_sources_are_refused(tmp_path) -> None:
    directory = shipped(tmp_path, sources=SOURCES[:-1])
    why = prebuilt.choose(SOURCES, directory, cpu_flags=AVX512_BF16)
    assert why == "the prebuilt libraries were built from other source files"


def test_no_manifest_means_no_prebuilt_library(tmp_path) -> None:
    assert "no prebuilt library" in prebuilt.choose(SOURCES, tmp_path, cpu_flags=AVX512_BF16)


def test_the_package_build_compiles_the_same_sources_as_the_run_time_build() -> None:
    """The package build takes every `csrc/*.cpp`; the run-time build takes `SOURCES`."""
    assert sorted(path.name for path in CSRC.glob("*.cpp")) == sorted(s.name for s in SOURCES)


def test_libraries_of_changed_sources_are_refused(tmp_path) -> None:
    manifest_path = shipped(tmp_path) / prebuilt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "digest": "an older csrc"}))
    why = prebuilt.choose(SOURCES, tmp_path, cpu_flags=AVX512_BF16)
    assert why == "the prebuilt libraries were built from other sources (csrc changed)"


def test_a_source_tree_serves_a_build_of_its_own(cpu_library) -> None:
    """No package build ran here (the tests run from the source tree), so no prebuilt
    library exists and the run-time build serves, and says so."""
    assert prebuilt.choose(SOURCES) == (
        f"no prebuilt library in {prebuilt.PREBUILT_DIR} (a source tree or an editable install)"
    )
    assert cpu_library.library == "built here"
