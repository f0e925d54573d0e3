"""The tool-call formats `tool_choice: auto` reads (vLLM's `hermes`, `mistral` and
`llama3_json` parsers): each on what its models write, the content a stream may send
before a call, the format a chat template picks, and, served, Mistral's and Llama 3's
calls read on a model whose output is forced with a regex (the models here are
random) and streamed, the server's `tool_call_parser` set or picked."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvscope.web.parsers.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    CallStream,
    HeldContent,
    ToolParser,
    parser_for,
)

from .conftest import ROOT, Live, bundled_with_template, running_server, serve_cli, wait_clean
from .test_tools import ASK, WEATHER, streamed_calls

ROME = {"city": "Rome"}


def read(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """The content before the calls, and each call's name and arguments."""
    first, calls = parser.calls(text)
    return text[:first], [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]


def test_mistral_reads_both_of_its_formats() -> None:
    array = '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}}, {"name": "clock", "arguments": {}}]'
    assert read(MISTRAL, "Checking. " + array) == ("Checking. ", [("weather", ROME), ("clock", {})])
    newer = '[TOOL_CALLS]weather[ARGS]{"city": "Rome"}[TOOL_CALLS]clock[ARGS]{}'
    assert read(MISTRAL, newer) == ("", [("weather", ROME), ("clock", {})])
    for text in ("no call here", "[TOOL_CALLS][{broken", "[TOOL_CALLS]weather{}", "[TOOL_CALLS][]"):
        assert read(MISTRAL, text) == (text, []), text


def test_llama3_reads_a_message_that_is_a_call() -> None:
    one = '{"name": "weather", "parameters": {"city": "Rome"}}'
    assert read(LLAMA3_JSON, one) == ("", [("weather", ROME)])
    assert read(LLAMA3_JSON, "<|python_tag|>" + one) == ("", [("weather", ROME)])
    two = one + '; {"name": "clock", "arguments": {}}'
    assert read(LLAMA3_JSON, two) == ("", [("weather", ROME), ("clock", {})])
    for text in ("The weather is fine.", "Here: " + one, '{"city": "Rome"}', one + " and then"):
        assert read(LLAMA3_JSON, text) == (text, []), text


def test_hermes_reads_blocks_anywhere() -> None:
    text = 'Sure.<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'
    assert read(HERMES, text) == ("Sure.", [("weather", ROME)])
    assert read(HERMES, "<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )


def test_a_stream_holds_back_only_what_may_become_a_call() -> None:
    mistral = HeldContent(MISTRAL)
    assert mistral.feed("Checking [TOOL") == "Checking "
    assert mistral.feed("S]") == "[TOOLS]"  # not the tag after all
    assert mistral.feed(" [TOOL_CALLS][{") == " "
    assert mistral.feed('"name": "weather", "arguments": {}}]') == ""
    assert mistral.rest(mistral.text) == ""
    # Llama 3: a message that opens with `{` (or the python tag) may be a call, whole.
    call = HeldContent(LLAMA3_JSON)
    assert call.feed(" ") == "" and call.feed('{"name"') == ""
    assert call.feed(': "weather", "parameters": {}}') == ""
    assert call.rest(call.text) == ""
    tagged = HeldContent(LLAMA3_JSON)
    assert tagged.feed("<|python") == "" and tagged.feed('_tag|>{"name": "x"') == ""
    prose = HeldContent(LLAMA3_JSON)
    assert prose.feed(" The") == " The" and prose.feed(' {"name": 1}') == ' {"name": 1}'
    broken = HeldContent(LLAMA3_JSON)
    assert broken.feed("{not json") == ""
    assert broken.rest(broken.text) == "{not json"  # no call: all of it is content


STREAMED = {
    HERMES: 'Checking. <tool_call>\n{"name": "weather", "arguments": {"city": "Rome", '
    '"days": [1, {"note": "a } and a \\" inside"}]}}\n</tool_call>\n'
    '<tool_call>{"name": "clock", "arguments": {}}</tool_call>',
    MISTRAL: 'Checking.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome", '
    '"days": [1, {"note": "a } and a \\" inside"}]}}, {"name": "clock", "arguments": {}}]',
    LLAMA3_JSON: '{"name": "weather", "parameters": {"city": "Rome", "days": [1, {"note": '
    '"a } and a \\" inside"}]}}; {"name": "clock", "parameters": {}}',
}


def fed(parser: ToolParser, text: str, size: int, *, single: bool = False) -> tuple[str, list]:
    """`text` streamed in pieces of `size` characters: the content sent, and the calls
    (name, arguments, argument deltas after the one that names it) as a client adds
    up the deltas."""
    held = HeldContent(parser)
    calls = CallStream(held, single=single)
    content, deltas = "", []
    for at in range(0, len(text), size):
        content += held.feed(text[at : at + size])
        deltas += calls.advance()
    _first, whole = parser.calls(text)
    content += "" if calls.opened else held.rest(text)
    deltas += calls.rest(whole[:1] if single else whole)
    merged: dict[int, list] = {}
    for delta in deltas:
        function = delta["function"]
        if delta["index"] not in merged:
            assert delta["id"] and delta["type"] == "function" and function["name"]
            merged[delta["index"]] = [function["name"], function["arguments"], 0]
        else:
            assert set(delta) == {"index", "function"} and set(function) == {"arguments"}
            merged[delta["index"]][1] += function["arguments"]
            merged[delta["index"]][2] += 1
    assert sorted(merged) == list(range(len(merged)))
    return content, [(name, json.loads(args), n) for name, args, n in merged.values()]


@pytest.mark.parametrize("parser", [HERMES, MISTRAL, LLAMA3_JSON], ids=lambda p: p.name)
def test_calls_stream_as_they_come_in_any_pieces(parser: ToolParser) -> None:
    text = STREAMED[parser]
    content, expected = read(parser, text)
    for size in (1, 2, 3, 5, 8, 13, len(text)):
        got_content, calls = fed(parser, text, size)
        assert got_content == content
        assert [(name, arguments) for name, arguments, _ in calls] == expected
        if size < 8:  # each call's arguments came in pieces, not whole at the end
            assert all(pieces > 1 for _, _, pieces in calls[:1]), calls
    _, [one] = fed(parser, text, 3, single=True)
    assert one[:2] == expected[0]


def test_what_cannot_stream_comes_whole_at_the_end() -> None:
    newer = '[TOOL_CALLS]weather[ARGS]{"city": "Rome"}[TOOL_CALLS]clock[ARGS]{}'
    content, calls = fed(MISTRAL, newer, 1)
    assert (content, calls) == ("", [("weather", ROME, 0), ("clock", {}, 0)])
    late = '<tool_call>{"arguments": {"city": "Rome"}, "name": "weather"}</tool_call>'
    assert fed(HERMES, "Hi. " + late, 1) == ("Hi. ", [("weather", ROME, 0)])
    broken = "Hi. <tool_call>not a call</tool_call>"
    assert fed(HERMES, broken, 1) == (broken, [])  # never read as a call: content


def test_the_chat_template_picks_the_format() -> None:
    assert parser_for("auto", "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") is MISTRAL
    assert parser_for("auto", "<|start_header_id|>ipython<|end_header_id|>") is LLAMA3_JSON
    assert parser_for("auto", "{{ '<|python_tag|>' }}") is LLAMA3_JSON
    assert parser_for("auto", "<tool_call>") is HERMES
    assert parser_for("auto", None) is HERMES
    assert parser_for("mistral", "<tool_call>") is MISTRAL  # named: as named


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{# calls come back as [TOOL_CALLS] #}"
)
LLAMA_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "mistral": bundled_with_template(tmp_path_factory.mktemp("mistral"), MISTRAL_TEMPLATE),
        "llama": bundled_with_template(tmp_path_factory.mktemp("llama"), LLAMA_TEMPLATE),
    }


@pytest.fixture(params=["mistral", "llama3_json"])
def served(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path, models: dict[str, Path]
) -> Iterator[tuple[Live, openai.OpenAI, str]]:
    """Mistral's picked by its template; Llama 3's named (its template shows nothing)."""
    parser = request.param
    options = {"tool_call_parser": "llama3_json"} if parser == "llama3_json" else {}
    model = models["mistral" if parser == "mistral" else "llama"]
    with (
        running_server(backend, tmp_path, model=str(model), **options) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        yield live, client, parser


FORCED = {
    "mistral": 'Let me look.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome"}}]',
    "llama3_json": '{"name": "weather", "parameters": {"city": "Rome"}}',
}
CONTENT = {"mistral": "Let me look.", "llama3_json": None}


def test_calls_are_read_in_the_servers_format(served: tuple[Live, openai.OpenAI, str]) -> None:
    live, client, parser = served
    forced = {"guided_regex": re.escape(FORCED[parser])}
    out = client.chat.completions.create(
        model="model", messages=ASK, tools=[WEATHER], max_tokens=200, extra_body=forced
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT[parser]
    [call] = choice.message.tool_calls
    assert call.function.name == "weather" and json.loads(call.function.arguments) == ROME
    stream = client.chat.completions.create(
        model="model", messages=ASK, tools=[WEATHER], max_tokens=200, extra_body=forced, stream=True
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == (CONTENT[parser] or "")
    [(name, arguments, pieces)] = streamed_calls(
        [call for d in deltas for call in d.delta.tool_calls or ()]
    )
    assert (name, arguments) == ("weather", ROME) and pieces > 1  # as they came
    assert deltas[-1].finish_reason == "tool_calls"
    wait_clean(live)


def test_kvscope_serve_takes_the_parsers_and_logs_them() -> None:
    process, _url = serve_cli(
        "asyncio",
        "--worker",
        "thread",
        "--tool-call-parser",
        "llama3_json",
        "--reasoning-parser",
        "deepseek_r1",
    )
    try:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    assert "tool calls read as llama3_json, reasoning parser deepseek_r1" in stderr
    refused = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "serve", "--tool-call-parser", "pythonic"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "--tool-call-parser" in refused.stderr
