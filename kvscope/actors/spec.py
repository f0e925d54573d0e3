"""`RequestSpec`: what a caller asks for, as one frozen value validated once.

`Engine.request`, `generate`, `submit` and `submit_samples` take a prompt, optional
`SamplingParams` and keyword options; `RequestSpec.build` sorts the options into the
request's own (`priority`, `parent`, `request_id`, `timeout`, `owner`, `samples`, the
`context` policy) and
sampling overrides (any `SamplingParams` field), and checks each once. What depends on
the model (the prompt's tokens, the context, the vocabulary) is admission's
(`admission.py`).
"""

from __future__ import annotations

from typing import Any, get_args

import attrs

from kvscope.errors import InvalidRequest
from kvscope.params import PRIORITY, TIMEOUT, ContextPolicy, SamplingParams

Prompt = str | list[int]


def _optional_str(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"{attribute.name} must be a string", field=attribute.name)


def _priority(_inst: object, _attribute: attrs.Attribute, value: object) -> None:
    PRIORITY.check("priority", value)


def _timeout(_inst: object, _attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    try:
        TIMEOUT.check("timeout", value)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{exc} seconds", field="timeout") from None


def _samples(_inst: object, _attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest("n must be a positive integer", field="n")


def _context(_inst: object, _attribute: attrs.Attribute, value: object) -> None:
    if value not in get_args(ContextPolicy):
        raise InvalidRequest(f"context must be 'refuse' or 'cap', not {value!r}", field="context")


@attrs.frozen(kw_only=True)
class RequestSpec:
    prompt: Prompt
    #: The caller's parameters (None: the model's generation defaults) ...
    params: SamplingParams | None = None
    #: ... and the fields it overrides, as (name, value) pairs.
    sampling: tuple[tuple[str, Any], ...] = ()
    priority: int = attrs.field(default=0, validator=_priority)
    parent: str | None = attrs.field(default=None, validator=_optional_str)
    request_id: str | None = attrs.field(default=None, validator=_optional_str)
    timeout: float | None = attrs.field(default=None, validator=_timeout)
    #: The API key id that made it (it sees and cancels only its own requests).
    owner: str | None = attrs.field(default=None, validator=_optional_str)
    #: How many samples of the prompt (OpenAI's `n`): one parent and its children.
    samples: int = attrs.field(default=1, validator=_samples)
    #: What admission does if the prompt and `max_tokens` overflow the context.
    context: ContextPolicy = attrs.field(default="cap", validator=_context)

    @classmethod
    def build(
        cls, prompt: Prompt, params: SamplingParams | None, options: dict[str, Any]
    ) -> RequestSpec:
        own = {name: options[name] for name in _OWN_FIELDS if name in options}
        sampling = {k: v for k, v in options.items() if k not in _OWN_FIELDS}
        unknown = set(sampling) - SamplingParams.fields()
        if unknown:
            names = sorted(unknown)
            raise InvalidRequest(f"unknown sampling field(s): {', '.join(names)}", field=names[0])
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be a SamplingParams")
        return cls(prompt=prompt, params=params, sampling=tuple(sampling.items()), **own)


_OWN_FIELDS = frozenset(
    field.name for field in attrs.fields(RequestSpec) if field.name not in ("prompt", "params")
) - {"sampling"}
