"""Server settings: what `kvscope serve` parsed, minus the engine's own settings.

`ServerSettings` is frozen and validated on construction; `api_keys` maps each key id
(a short, stable name derived from the key, safe to log and to write to the audit log)
to the secret key. The engine's settings travel separately as `Engine.open` kwargs.
"""

from __future__ import annotations

import hashlib
from typing import cast

import attrs
from attrs import validators as v

from kvscope.scheduling import LOOP_PRIORITY, LOOP_SLICE

from .asgi.cors import CorsPolicy
from .asgi.root_path import checked_root_path
from .parsers.reasoning import PARSERS as REASONING_PARSERS
from .parsers.tool_calls import PARSERS


def key_id(key: str) -> str:
    """A stable, non-secret name for an API key: what logs and the audit log show."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _keys(value: object) -> dict[str, str]:
    if isinstance(value, dict):
        return dict(value)
    keys = [k.strip() for k in (value or ()) if k and k.strip()]  # type: ignore[attr-defined]
    return {key_id(k): k for k in keys}


def _cors(value: CorsPolicy | dict[str, object]) -> CorsPolicy:
    """A policy, or one as `attrs.asdict` left it (replicas get their settings so)."""
    if isinstance(value, CorsPolicy):
        return value
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    return CorsPolicy(**fields)  # type: ignore[arg-type]


def _slice_seconds(
    _: object, attribute: attrs.Attribute[float | None], value: float | None
) -> None:
    if value is not None and not 0.0001 <= value <= 0.1:
        raise ValueError(f"{attribute.name} must be None or 0.0001-0.1 s, not {value!r}")


#: Seconds between two samples of the event loop's lag (and of `bench cancel`'s
#: wake-up floor beside it).
LAG_INTERVAL = 0.05
#: Seconds between two lines of the periodic stats log (vLLM's interval).
STATS_LOG_INTERVAL = 10.0


@attrs.frozen(kw_only=True)
class ServerSettings:
    #: The address it listens on (0.0.0.0: every interface).
    host: str = "127.0.0.1"
    #: 0 asks the OS for a free port (the bound one is printed and logged).
    port: int = attrs.field(default=8000, validator=[v.ge(0), v.le(65535)])
    backend: str = attrs.field(default="asyncio", validator=v.in_(("asyncio", "trio")))
    #: key id -> secret key; empty means no authentication.
    api_keys: dict[str, str] = attrs.field(factory=dict, converter=_keys)
    #: Largest request body (and WebSocket message) accepted, in bytes (413 past it).
    max_body_bytes: int = attrs.field(default=1 << 20, validator=v.gt(0))
    #: On SIGINT/SIGTERM, let live requests finish for this long before cancelling them.
    drain_timeout: float = attrs.field(default=0.0, validator=v.ge(0.0))
    #: Seconds shutdown waits for requests to end and streams to send their last event.
    graceful_timeout: float = attrs.field(default=5.0, validator=v.gt(0.0))
    #: Seconds between two event-loop lag samples of the monitor task.
    lag_interval: float = attrs.field(default=LAG_INTERVAL, validator=v.gt(0.0))
    #: The scheduler slice the event loop's thread asks for, in seconds (None: the
    #: default; see `kvscope.scheduling`).
    loop_slice: float | None = attrs.field(
        default=cast("float | None", LOOP_SLICE), validator=_slice_seconds
    )
    #: The real-time (SCHED_FIFO) priority the event loop's thread asks for, 1-99, where
    #: the OS allows it (0: none; see `kvscope.scheduling`).
    loop_priority: int = attrs.field(default=LOOP_PRIORITY, validator=[v.ge(0), v.le(99)])
    #: Responses (`/v1/responses` with `store`) kept for GET and `previous_response_id`,
    #: and the bytes of their conversations; past either the oldest go first.
    stored_responses: int = attrs.field(default=1000, validator=v.ge(0))
    stored_responses_bytes: int = attrs.field(default=64 << 20, validator=v.ge(0))
    #: How `tool_choice: auto` reads calls out of the text (`web.parsers.tool_calls`);
    #: `auto` picks the format the chat template shows.
    tool_call_parser: str = attrs.field(default="auto", validator=v.in_(PARSERS))
    #: How a thinking model's reasoning is told from its answer (`web.parsers.reasoning`);
    #: `none` leaves the text whole.
    reasoning_parser: str = attrs.field(default="none", validator=v.in_(REASONING_PARSERS))
    #: Which browser origins may call, and how (`web.asgi.cors`); none unless told.
    cors: CorsPolicy = attrs.field(factory=CorsPolicy, converter=_cors)
    #: Seconds between two lines of the periodic stats log (`web.ops.stats_log`); 0: none.
    stats_log_interval: float = attrs.field(default=STATS_LOG_INTERVAL, validator=v.ge(0.0))
    #: vLLM's runtime LoRA loading (`web/openai/lora_admin.py`): `POST /v1/load_lora_adapter`
    #: and `/v1/unload_lora_adapter`; `kvscope serve` sets it from
    #: VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM does.
    runtime_lora_updating: bool = attrs.field(default=False, validator=v.instance_of(bool))
    #: Retry-After seconds sent with a 429.
    retry_after: int = attrs.field(default=1, validator=v.ge(0))
    #: vLLM's `--enable-prompt-tokens-details`: usage counts the prompt tokens the prefix
    #: cache held (`prompt_tokens_details.cached_tokens`); off unless asked, as vLLM's.
    prompt_tokens_details: bool = attrs.field(default=False, validator=v.instance_of(bool))
    #: vLLM's `--return-tokens-as-token-ids`: log-probabilities show each token as
    #: `token_id:N` unless a request's `return_tokens_as_token_ids` says otherwise.
    return_tokens_as_token_ids: bool = attrs.field(default=False, validator=v.instance_of(bool))
    #: vLLM's `--enable-force-include-usage`: every stream sends usage, on each chunk and
    #: in a last usage chunk, whatever its `stream_options` say.
    force_include_usage: bool = attrs.field(default=False, validator=v.instance_of(bool))
    #: vLLM's `--root-path`: the routes are answered under this prefix too (`/llm`:
    #: `/llm/v1/...` as `/v1/...`), as behind a proxy that keeps it; empty: none.
    root_path: str = attrs.field(default="", converter=checked_root_path)
    #: The model as `kvscope serve` was given it (a checkpoint's path): the model card's
    #: `root`, as vLLM's; None: the name it is served as.
    model_path: str | None = None
