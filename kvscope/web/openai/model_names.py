"""Which model a request's `model` names: the one this server runs, or one of its LoRA
adapters (`EngineConfig.lora_modules`), as vLLM serves them under their own names."""

from __future__ import annotations

from kvscope import Engine

from ..errors import ApiError


def check_model(engine: Engine, name: str | None) -> None:
    """A 404 (`model_not_found`) unless `name` is this server's model, one of its LoRA
    adapters, or unset."""
    if name is not None and name != engine.model_name and name not in engine.adapters:
        served = ", ".join(f"`{n}`" for n in (engine.model_name, *engine.adapters))
        raise ApiError(
            404,
            f"The model `{name}` does not exist (this server runs {served}).",
            param="model",
            code="model_not_found",
        )


def adapter_of(engine: Engine, name: str | None) -> str | None:
    """The LoRA adapter a body's `model` names (`SamplingParams.lora`); None for the
    base model. The answer's `model` is the name asked for: `adapter or model_name`."""
    return name if name is not None and name in engine.adapters else None
