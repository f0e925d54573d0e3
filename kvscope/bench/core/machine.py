"""What the benchmark ran on (CPU, cores, load, versions, kvscope's revision): the
`Machine` record every result carries."""

from __future__ import annotations

import os
import platform
import sys
import time

import attrs

from .records import Record


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


#: The CPU's vector extensions that decide which paths the kernels take (AVX2 only,
#: AVX-512 with BF16, AMX tiles): two machines of one model name may differ in them.
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def vector_extensions() -> list[str] | None:
    """Which of `VECTOR_FLAGS` this CPU has (None where /proc/cpuinfo cannot tell)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [flag for flag in VECTOR_FLAGS if flag in flags]
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def git_revision() -> str | None:
    """The checkout's commit, with `-dirty` when tracked files differ from it."""
    import subprocess
    from pathlib import Path

    import kvscope

    root = Path(kvscope.__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


@attrs.frozen(kw_only=True)
class Machine(Record):
    cpu: str
    cores: int | None
    platform: str
    python: str
    torch: str
    started: str
    load_average_at_start: list[float] | None
    load_average_at_end: list[float] | None = None
    #: `git describe --always --dirty` of the checkout; `-dirty`: uncommitted changes.
    kvscope_revision: str | None = None
    transformers: str | None = None
    vllm: str | None = None
    #: `llama-server --version`'s first line, where the llama.cpp peer ran.
    llama_cpp: str | None = None
    #: `vector_extensions()`: which kernels' paths the figures are of.
    vector_extensions: list[str] | None = None

    def summary(self) -> str:
        """The line the tables start with: the revision and the CPU."""
        isa = f" ({', '.join(self.vector_extensions)})" if self.vector_extensions else ""
        return f"kvscope revision {self.kvscope_revision}; {self.cpu}{isa}, {self.cores} cores"

    @property
    def clean(self) -> bool:
        return self.kvscope_revision is not None and not self.kvscope_revision.endswith("-dirty")

    def ended(self) -> Machine:
        return attrs.evolve(self, load_average_at_end=load_average())


def describe() -> Machine:
    """This machine now; prints a warning when the checkout has uncommitted changes."""
    import torch

    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:
        transformers_version = None
    machine = Machine(
        cpu=cpu_model(),
        cores=os.cpu_count(),
        platform=platform.platform(),
        python=sys.version.split()[0],
        torch=torch.__version__,
        load_average_at_start=load_average(),
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        kvscope_revision=git_revision(),
        transformers=transformers_version,
        vector_extensions=vector_extensions(),
    )
    if not machine.clean:
        print(
            f"WARNING: kvscope revision {machine.kvscope_revision}: figures of a tree "
            "with uncommitted changes cannot be traced to a commit",
            flush=True,
        )
    return machine
