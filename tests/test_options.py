"""The engine options of `kvscope serve` and `kvscope generate` come from `EngineConfig`:
every field is an option with the field's default and a help text, and a bad value is
refused by the config's own validation; `kvscope serve` has its own defaults for where
the model runs, one server's or Ray Serve replicas'."""

from __future__ import annotations

import argparse

import attrs
import pytest

from kvscope import serve
from kvscope.config import EngineConfig
from kvscope.options import add_engine_arguments, engine_kwargs, field_help
from kvscope.web import serve as one_server
from kvscope.web.openai import lora_admin
from kvscope.web.settings import ServerSettings


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


def test_one_server_and_its_replicas_take_their_own_worker_defaults() -> None:
    """One server runs the model in a worker process on cores of its own (`auto`);
    replicas in threads, and a replica's worker process keeps every core, since the
    replicas on one machine would each take the same ones. What is given wins."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)

    def chosen(*argv: str) -> tuple[str, str]:
        args = serve.with_worker_defaults(parser.parse_args(argv))
        return args.worker, args.worker_cores

    assert chosen() == ("process", "auto")
    assert chosen("--replicas", "2") == ("thread", "all")
    assert chosen("--replicas", "2", "--worker", "process") == ("process", "all")
    given = ("--worker", "thread", "--worker-cores", "all")
    assert chosen(*given) == ("thread", "all")
    assert chosen("--replicas", "2", "--worker-cores", "auto") == ("thread", "auto")
    help_text = " ".join(parser.format_help().split())
    assert "--worker-cores WORKER_CORES" in help_text
    assert "(default: auto; all with --replicas)" in help_text


def test_the_server_flags_default_to_server_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvscope serve` with no flags makes the `ServerSettings` of the class's own
    defaults: each flag reads its field's default (and its comment, as help), so a
    default is written once."""
    for variable in (*one_server.KEY_VARIABLES, "KVSCOPE_API_KEY_FILE", lora_admin.SWITCH):
        monkeypatch.delenv(variable, raising=False)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert one_server.settings_from(parser.parse_args([])) == ServerSettings()
    text = " ".join(parser.format_help().split())
    assert "--host HOST The address it listens on (0.0.0.0: every interface)." in text
    given = parser.parse_args(["--port", "0", "--drain-timeout", "1.5", "--loop-priority", "0"])
    settings = one_server.settings_from(given)
    assert (settings.port, settings.drain_timeout, settings.loop_priority) == (0, 1.5, 0)
