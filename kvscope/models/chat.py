"""Chat templates: render a checkpoint's `chat_template` exactly as `transformers`'
`apply_chat_template(..., tokenize=False)` does.

Same jinja2 environment (`ImmutableSandboxedEnvironment` with `trim_blocks`,
`lstrip_blocks` and loop controls; a `{% generation %}` block tag), same filter
(`tojson` without HTML escaping) and globals (`raise_exception`, `strftime_now`, a
restricted `dict` and `namespace`), and the same inputs: the messages with `None`
values dropped and reasoning fields aliased, `tools`, `documents`,
`add_generation_prompt`, and the tokenizer's named special tokens (`bos_token`,
`eos_token`, ...) as strings. A rendered chat already holds its special tokens, so
encode it with `add_special_tokens=False` (`encode_chat` does).

Templates are compiled once per distinct string. A template that raises (through
`raise_exception`, e.g. "roles must alternate") raises `ChatTemplateError`, an
`InvalidRequest`, since it is the messages that are wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvscope.errors import InvalidRequest

from .errors import ModelLoadError

#: The named special tokens transformers passes to every template (when set).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(InvalidRequest):
    """The chat template refused the messages (or failed while rendering them)."""


# -- the environment ------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it
    to find assistant tokens; rendering is unaffected)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` inside templates, without attribute access to the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, args = args[0], args[1:]
        values = dict(*args, **kwargs)
        for name in values:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set attribute {name!r} on a namespace"
            )


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


# -- rendering ------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A copy built of plain JSON types only (the sandbox sees nothing richer)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop `None` values, copy to plain data, alias reasoning fields (as transformers)."""
    chat = []
    for message in messages:
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()  # type: ignore[attr-defined]
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"a chat message must be an object, not {message!r}")
        plain = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        chat.append(plain)
    return chat


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """The prompt string `template` renders for `messages`.

    `extra` holds further template variables: other special tokens (`pad_token`, ...)
    and template options such as `enable_thinking`. Note that transformers'
    `apply_chat_template` defaults `add_generation_prompt` to False; this defaults to
    True because a server renders a chat to generate its reply.
    """
    if not messages:
        raise ChatTemplateError("a chat needs at least one message")
    special = {"bos_token": bos_token, "eos_token": eos_token}
    variables = {k: v for k, v in special.items() if v is not None}
    variables.update(_plain(extra))
    try:
        return compile_template(template).render(
            messages=_normalize(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is malformed: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None


# -- templates and special tokens of a checkpoint ---------------------------------------


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of `tokenizer_config.json`, as the strings templates see."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def given_chat_template(value: str) -> str:
    """A chat template given in place of a checkpoint's (`EngineConfig.chat_template`):
    the template itself, or the path of a file holding one (text with no `{`, as vLLM's
    `--chat-template` takes either). Checked to compile."""
    if "{" not in value:
        path = Path(value)
        if not path.is_file():
            raise ModelLoadError(f"chat_template: no template and no file {value!r}")
        value = path.read_text(encoding="utf-8")
    try:
        compile_template(value)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ModelLoadError(f"chat_template does not compile: {exc}") from None
    return value


def read_chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The checkpoint's chat template: `chat_template.jinja` if present (where
    transformers 5 saves it), else `tokenizer_config.json`'s `chat_template` (a string,
    or a list of named templates of which "default" is taken). Checked to compile."""
    path = directory / "chat_template.jinja"
    template: Any = (
        path.read_text(encoding="utf-8")
        if path.is_file()
        else tokenizer_config.get("chat_template")
    )
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ModelLoadError(
            f"{directory}: chat_template is a {type(template).__name__}, not a string"
        )
    try:
        compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ModelLoadError(f"{directory}: the chat template does not compile: {exc}") from None
    return template
