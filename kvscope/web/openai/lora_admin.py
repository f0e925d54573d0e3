"""vLLM's runtime LoRA loading: `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`)
and `POST /v1/unload_lora_adapter` (`lora_name`), served where
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set (`ServerSettings.runtime_lora_updating`); as
vLLM's, they are absent otherwise (a 404 saying how to turn them on). Keys are needed
as on every route.

A load reads the adapter and checks it against the model before it answers (400 saying
why it cannot be served; 409 for a name in use); from then on a body's `model` may name
it. An unload is refused (409) while requests run with the adapter, and a name not
loaded is a 404. The answers are vLLM's plain-text lines.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint

from ..context import server
from ..errors import ApiError
from .completions import read_openai_body

blueprint = Blueprint("lora_admin", __name__, url_prefix="/v1")

#: The variable that turns the routes on (vLLM's), and the values that mean yes.
SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
SWITCH_ON = ("1", "true")


class LoadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, description="the name requests give as `model`")
    lora_path: str = Field(min_length=1, description="the adapter's directory, as PEFT saved it")


class UnloadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="vLLM's; accepted, the name decides")


def _check_switched_on() -> None:
    if not server().settings.runtime_lora_updating:
        raise ApiError(404, f"runtime LoRA loading is off: start the server with {SWITCH}=True")


@blueprint.post("/load_lora_adapter")
async def load_lora_adapter() -> Any:
    """Load a LoRA adapter and serve it under its name."""
    _check_switched_on()
    body = await read_openai_body(LoadAdapterBody)
    await server().engine.load_adapter(body.lora_name, body.lora_path)
    text = f"Success: LoRA adapter '{body.lora_name}' added successfully."
    return text, 200, {"Content-Type": "text/plain; charset=utf-8"}


@blueprint.post("/unload_lora_adapter")
async def unload_lora_adapter() -> Any:
    """Stop serving a LoRA adapter and free it."""
    _check_switched_on()
    body = await read_openai_body(UnloadAdapterBody)
    server().engine.unload_adapter(body.lora_name)
    text = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
    return text, 200, {"Content-Type": "text/plain; charset=utf-8"}
