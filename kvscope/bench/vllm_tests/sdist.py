"""vLLM's test files, from vLLM's source distribution on PyPI (docs/vllm-tests.md).

vLLM's tests are not in its wheel, and kvscope does not carry vLLM's code: `fetch`
downloads the release's sdist once into the cache and checks its SHA-256 against the one
pinned here (every later run checks the cached copy again); `extract` unpacks its
`tests/` tree and `pyproject.toml` (pytest's settings: the markers the tests use).
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import urllib.request
from pathlib import Path

#: The release whose tests run, its sdist on PyPI (found from https://pypi.org/simple/vllm/)
#: and the SHA-256 PyPI lists for it.
VLLM_VERSION = "0.32.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"

#: What `extract` unpacks, below the sdist's top directory.
EXTRACTED = ("tests/", "pyproject.toml")


class ChecksumError(RuntimeError):
    """A file's SHA-256 is not the one pinned for it."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check(path: Path, sha256: str) -> Path:
    """`path`, once its SHA-256 is `sha256`; ChecksumError names both if not."""
    found = sha256_of(path)
    if found != sha256:
        raise ChecksumError(f"{path}: SHA-256 {found}, expected {sha256}")
    return path


def fetch(cache: Path, url: str = SDIST_URL, sha256: str = SDIST_SHA256) -> Path:
    """The sdist at `url`, downloaded into `cache` unless there, checked against `sha256`."""
    path = cache / url.rsplit("/", 1)[-1]
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with urllib.request.urlopen(url, timeout=60) as response, partial.open("wb") as f:
            shutil.copyfileobj(response, f)
        try:
            check(partial, sha256)
        except ChecksumError:
            partial.unlink()
            raise
        partial.rename(path)
    return check(path, sha256)


def extract(archive: Path, dest: Path) -> Path:
    """Unpack the archive's `EXTRACTED` parts into `dest` (once); the source root there."""
    with tarfile.open(archive) as tar:
        first = tar.next()
        assert first is not None, f"{archive} is empty"
        top = first.name.split("/", 1)[0]
        root = dest / top
        done = root / ".extracted"
        if done.exists():
            return root
        wanted = [
            member
            for member in tar.getmembers()
            if any(member.name.startswith(f"{top}/{part}") for part in EXTRACTED)
        ]
        tar.extractall(dest, members=wanted, filter="data")
    done.write_text(archive.name)
    return root
