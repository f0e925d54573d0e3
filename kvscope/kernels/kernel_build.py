"""The compiled CPU library's build on this machine: where the C++ compiler is, the
command that compiles `csrc/`, the cache directory its builds live in, and the
background build itself.

A build is made once per machine, the first time an engine runs on the CPU with no
prebuilt library that fits (`prebuilt.py`), into a cache directory
(`$KVSCOPE_KERNEL_CACHE`, else `$TORCH_EXTENSIONS_DIR/kvscope`, else
`~/.cache/kvscope/kernels`), by invoking the C++ compiler (`$CXX`, default `g++`)
directly on the sources with torch's headers and libraries: no build tool, no new
dependency. Its vector path follows the CPU (`-march=native`), so the cache key names
the CPU's flags besides the sources, torch and the compiler. The package build
compiles the same command with a fixed `-march` per instruction-set variant instead.

This module imports nothing of kvscope's (only torch, lazily), so that the package
build (`setup.py`) can load it without the package's dependencies.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
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
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: Flags beyond torch's include and library paths and `-march`. The run-time build takes
#: `-march=native`: it is for this machine only, and its cache key includes the CPU's flags.
FLAGS = ("-O3", "-ffp-contract=fast", "-std=gnu++20", "-shared", "-fPIC")
NATIVE = ("-march=native",)
#: Builds kept in the cache besides the one in use: other venvs (another torch, another
#: compiler) may share the cache, so a few recent ones stay; older ones are deleted.
KEEP_OTHER_BUILDS = 3
#: A build's private file while the compiler writes it (renamed once whole); one older
#: than `ABANDONED_AFTER` seconds was left by a process that exited mid-build.
BUILDING_PREFIX = "building-"
ABANDONED_AFTER = 3600.0


def cache_dir() -> Path:
    if explicit := os.environ.get("KVSCOPE_KERNEL_CACHE"):
        return Path(explicit)
    if torch_dir := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(torch_dir) / "kvscope"
    return Path.home() / ".cache" / "kvscope" / "kernels"


def compiler() -> str | None:
    """The C++ compiler's path, or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def cpu_flags_line() -> str:
    """The `flags` line of /proc/cpuinfo, or "" where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_command(
    cxx: str, sources: Sequence[Path], output: Path, march: Sequence[str] = NATIVE
) -> list[str]:
    """The compiler's command line for a library of `sources` at `output`, its vector
    path chosen by `march` (flags such as `-march=x86-64-v3`)."""
    import torch
    from torch.utils.cpp_extension import include_paths

    torch_lib = str(Path(torch.__file__).parent / "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        *FLAGS,
        *march,
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


def sources_digest() -> str:
    """A hash of every file of `csrc` (the headers beside the sources are theirs too)."""
    key = hashlib.sha256()
    for source in sorted(CSRC.iterdir()):
        if source.is_file():
            key.update(source.read_bytes())
    return key.hexdigest()


def library_path(cxx: str, sources: Sequence[Path]) -> Path:
    """Where the build of `sources` for this torch, compiler and CPU lives."""
    import torch

    key = hashlib.sha256(sources_digest().encode())
    # The sources' names too: a build of fewer of csrc's files must not pass for one of
    # all of them (by name: the same sources installed elsewhere, another venv's, share it)
    names = (source.name for source in sources)
    flags = " ".join((*FLAGS, *NATIVE))
    for part in (torch.__version__, cxx, flags, cpu_flags_line(), *names):
        key.update(part.encode())
    key.update(sys.version.encode())
    return cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"


Launch = Callable[[list[str]], "subprocess.Popen[str]"]


def compile_library(cxx: str, sources: Sequence[Path], path: Path, launch: Launch) -> str:
    """Build `sources` for this machine into `path`; "" once done, else why not. The
    compiler is started by `launch`, so that its owner can stop it (or refuse to start
    it, raising OSError, once its process is exiting)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Build under a private name, then rename: concurrent builds never see half a file.
        fd, tmp = tempfile.mkstemp(prefix=BUILDING_PREFIX, suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            with launch(build_command(cxx, sources, Path(tmp))) as build:
                _, stderr = build.communicate()
        except OSError:
            os.unlink(tmp)
            raise
        if build.returncode != 0:
            os.unlink(tmp)
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            return f"the build failed ({tail})"
        os.replace(tmp, path)
    except OSError as exc:
        return f"the build failed ({exc})"
    return ""


class BackgroundBuild:
    """One build of the library into the cache, stopped if this process exits first."""

    def __init__(self, cxx: str, sources: Sequence[Path]) -> None:
        self.cxx, self.sources = cxx, sources
        self.path = library_path(cxx, sources)
        self._processes: list[subprocess.Popen[str]] = []
        # Launching and stopping hold one lock: a compiler started while the process
        # exits (the build thread is a daemon) would otherwise slip past `stop`.
        self._lock = threading.Lock()
        self._stopped = False
        atexit.register(self.stop)

    def run(self) -> tuple[str, float]:
        """Build (in the calling thread); ("", seconds) once done, else (why not, 0)."""
        started = time.perf_counter()
        why_not = compile_library(self.cxx, self.sources, self.path, self._launch)
        if why_not:
            return why_not, 0.0
        prune_builds(self.path)
        return "", time.perf_counter() - started

    def _launch(self, command: list[str]) -> subprocess.Popen[str]:
        with self._lock:
            if self._stopped:
                raise OSError("the process is exiting")
            # Its own process group, so that `stop` stops the compiler's children too.
            build = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self._processes.append(build)
            return build

    def stop(self) -> None:
        """(at exit) Stop a build still running, and start none after: it would outlive
        this process, and its private file stays for `prune_builds` to find abandoned."""
        with self._lock:
            self._stopped = True
        for build in self._processes:
            if build.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(build.pid, signal.SIGKILL)
                build.wait()


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
