"""Command-line options derived from `EngineConfig`, for every command that opens an
engine (`kvscope serve`, `kvscope generate`); `field_help` and `value_type` serve the
server's own settings' flags the same way (`web/serve.py`, from `ServerSettings`).

Each field of `EngineConfig` becomes one option (`max_num_seqs` -> `--max-num-seqs`)
with the field's default and its `#:` comment as the help, so a setting, its default
and its description are written once, on the config class. Validation stays there too:
`engine_kwargs` builds the `EngineConfig`, which raises a `ValueError` naming the field.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvscope.config import EngineConfig

#: Fields the model-loading options cover, besides the `EngineConfig` ones.
MODEL_OPTIONS = ("model", "device", "dtype")
#: The model a command runs unless told: the one inside the package.
DEFAULT_MODEL = "bundled"


def field_help(settings: type = EngineConfig) -> dict[str, str]:
    """Each field's `#:` comment in the source of `settings`, an attrs class
    (`EngineConfig` unless told; what the docs show too)."""
    helps: dict[str, str] = {}
    comment: list[str] = []
    for line in inspect.getsource(settings).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            comment.append(stripped[2:].strip())
        elif match := re.match(r"(\w+)\s*:", stripped):
            if comment:
                helps[match.group(1)] = " ".join(comment)
            comment = []
        else:
            comment = []
    return helps


def value_type(annotation: Any) -> type:
    """`int | None` -> int; `float` -> float."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return annotation


def add_engine_arguments(
    parser: argparse.ArgumentParser, defaults: Mapping[str, tuple[Any, str]] | None = None
) -> None:
    """The model's and `EngineConfig`'s options; `defaults` gives a command its own
    default for a field: name -> (the value, what the help says it is)."""
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model",
        default=None,
        help=(
            "smollm2 (a real chat model, fetched once) | a .gguf file | a Hugging Face "
            f"checkpoint dir | bundled | tiny-random (default: {DEFAULT_MODEL})"
        ),
    )
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    group.add_argument(
        "--backend", default="asyncio", choices=["asyncio", "trio"], help="event loop"
    )
    group.add_argument("--log-level", default="INFO")
    helps = field_help()
    hints = typing.get_type_hints(EngineConfig)
    for field in attrs.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = value_type(hints[field.name])
        help_text = helps.get(field.name, "")
        default, shown = (defaults or {}).get(field.name, (field.default, "%(default)s"))
        if "parse" in field.metadata:  # a value of its own syntax, maybe repeated
            group.add_argument(
                flag,
                type=_said(field.metadata["parse"]),
                nargs=field.metadata.get("nargs"),
                default=default,
                help=help_text,
            )
        elif kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            shown = "" if default is None and field.default is None else f" (default: {shown})"
            group.add_argument(flag, type=kind, default=default, help=help_text + shown)


def _said(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` with its `ValueError`'s message shown by argparse (which otherwise says
    only "invalid value")."""

    def parse_argument(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_argument


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `Engine.open` keyword arguments that `add_engine_arguments` parsed; a bad
    value raises `ValueError` naming the field."""
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in attrs.fields(EngineConfig)})
    model = {name: getattr(args, name) for name in MODEL_OPTIONS}
    return model | {"model": args.model or DEFAULT_MODEL} | attrs.asdict(config)
