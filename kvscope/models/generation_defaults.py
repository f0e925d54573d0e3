"""The sampling defaults a model is served with: a checkpoint's generation_config.json,
none (vLLM's), or another directory's, with a JSON override laid over
(`EngineConfig.generation_config`, `override_generation_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvscope.params import GENERATION_DEFAULTED, SamplingParams

from .errors import ModelLoadError


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path.parent} has no {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def chosen_defaults(own: dict[str, Any], source: str, override: str | None) -> dict[str, Any]:
    """The sampling defaults: the checkpoint's `own` (`auto`), none (`vllm`), or a
    directory's generation_config.json's; then `override`'s (JSON) laid over."""
    if source == "auto":
        defaults = dict(own)
    elif source == "vllm":
        defaults = {}
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ModelLoadError(f"generation_config: {source} holds no generation_config.json")
        defaults = generation_defaults(read_json(path))
    if override:
        try:
            extra = json.loads(override)
        except ValueError as exc:
            raise ModelLoadError(f"override_generation_config is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ModelLoadError("override_generation_config must be a JSON object")
        unknown = sorted(set(extra) - set(GENERATION_DEFAULTED))
        if unknown:
            raise ModelLoadError(
                f"override_generation_config sets {unknown[0]}; it takes "
                f"{', '.join(GENERATION_DEFAULTED)}"
            )
        defaults |= extra
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"the sampling defaults are invalid: {exc}") from None
    return defaults


def generation_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """What a generation_config.json sets of the sampling defaults."""
    return {k: generation[k] for k in GENERATION_DEFAULTED if k in generation}
