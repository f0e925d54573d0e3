"""The engine options of `kvscope serve` and `kvscope generate` come from `EngineConfig`:
every field is an option with the field's default and a help text, and a bad value is
refused by the config's own validation."""

from __future__ import annotations

import argparse

import attrs
import pytest

from kvscope.config import EngineConfig
from kvscope.options import add_engine_arguments, engine_kwargs, field_help


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_every_setting_is_an_option_with_its_default_and_help() -> None:
    helps = field_help()
    defaults = engine_kwargs(parse())
    for field in attrs.fields(EngineConfig):
        assert helps.get(field.name), f"EngineConfig.{field.name} has no #: comment"
        assert defaults[field.name] == field.default, field.name


def test_every_help_text_renders() -> None:
    """argparse formats each help with `%`: a bare percent sign in a field's comment
    would break `kvscope serve --help`."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--worker-nice WORKER_NICE" in text and "(default: 10)" in text


def test_options_reach_the_config() -> None:
    kwargs = engine_kwargs(
        parse("--max-num-seqs", "7", "--watermark", "0.5", "--no-enable-prefix-caching", "--debug")
    )
    assert kwargs["max_num_seqs"] == 7
    assert kwargs["watermark"] == 0.5
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["debug"] is True
    assert kwargs["model"] == "bundled"


def test_a_bad_value_names_the_field() -> None:
    with pytest.raises(ValueError, match="block_size"):
        engine_kwargs(parse("--block-size", "0"))
