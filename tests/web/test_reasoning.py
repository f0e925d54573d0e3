"""A thinking model's reasoning told from its answer (vLLM's `--reasoning-parser`):
each parser's rule on whole outputs, a stream's pieces adding up to the same split
however the text comes, and, served, `reasoning_content` beside the content (whole and
streamed, tool calls read from the answer only) on output forced with a regex."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvscope.web.parsers.reasoning import ReasoningParser, ReasoningStream

from .conftest import Live, running_server, wait_clean
from .test_tools import WEATHER, streamed_calls

QWEN3, R1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")
OUTPUTS = [
    "<think>\nLet me see.\n</think>\n\nIt is 4.",
    "  <think>cut short",
    "<think></think>Only the answer.",
    "No thinking at all.",
    "reasoning without the open tag</think>The answer.",
    "<thin",
    "",
    "a </thin and more",
]


def test_each_parser_splits_a_whole_output() -> None:
    assert QWEN3.split(OUTPUTS[0]) == ("\nLet me see.\n", "\n\nIt is 4.")
    assert QWEN3.split(OUTPUTS[1]) == ("cut short", None)
    assert QWEN3.split(OUTPUTS[2]) == (None, "Only the answer.")
    assert QWEN3.split(OUTPUTS[3]) == (None, "No thinking at all.")
    assert R1.split(OUTPUTS[3]) == ("No thinking at all.", None)
    assert R1.split(OUTPUTS[4]) == ("reasoning without the open tag", "The answer.")
    assert ReasoningParser("none").split(OUTPUTS[0]) == (None, OUTPUTS[0])


@pytest.mark.parametrize("parser", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_a_stream_adds_up_to_the_whole_split(parser: ReasoningParser) -> None:
    """Every way of cutting each output into pieces of 1-3 characters (and whole)."""
    for text in OUTPUTS:
        whole = tuple(part or None for part in parser.split(text))
        for size in (1, 2, 3, len(text) or 1):
            stream = ReasoningStream(parser)
            thought, said = "", ""
            for start in range(0, len(text), size):
                piece = stream.feed(text[start : start + size])
                thought, said = thought + piece[0], said + piece[1]
            rest = stream.finish()
            thought, said = thought + rest[0], said + rest[1]
            assert (thought or None, said or None) == whole, (text, size)


@pytest.fixture
def served(backend: str, tmp_path: Path) -> Iterator[tuple[Live, openai.OpenAI]]:
    with (
        running_server(backend, tmp_path, reasoning_parser="qwen3") as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        yield live, client


ASK = [{"role": "user", "content": "2+2?"}]
FORCED = "<think>Two and two.</think>It is 4."


def forced(text: str) -> dict[str, object]:
    return {"guided_regex": re.escape(text)}


def test_reasoning_content_beside_the_answer(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    out = client.chat.completions.create(
        model="tiny-random", messages=ASK, max_tokens=100, extra_body=forced(FORCED)
    )  # type: ignore[call-overload]
    message = out.choices[0].message
    assert message.content == "It is 4."
    assert message.model_extra["reasoning_content"] == "Two and two."  # type: ignore[index]
    stream = client.chat.completions.create(
        model="tiny-random", messages=ASK, max_tokens=100, extra_body=forced(FORCED), stream=True
    )  # type: ignore[call-overload]
    deltas = [c.choices[0].delta for c in stream if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert thought == "Two and two."
    assert "".join(d.content or "" for d in deltas) == "It is 4."
    # The reasoning came first, the answer after it.
    kinds = [
        "r" if getattr(d, "reasoning_content", None) else "c"
        for d in deltas
        if d.content or getattr(d, "reasoning_content", None)
    ]
    assert kinds == sorted(kinds, reverse=True)
    plain = client.chat.completions.create(
        model="tiny-random", messages=ASK, max_tokens=100, extra_body=forced("Just 4.")
    )  # type: ignore[call-overload]
    assert plain.choices[0].message.content == "Just 4."
    assert plain.choices[0].message.model_extra["reasoning_content"] is None  # type: ignore[index]
    wait_clean(live)


def test_tool_calls_are_read_from_the_answer(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'
    text = f"<think>Use {call} maybe.</think>Sure.{call}"
    for stream in (False, True):
        out = client.chat.completions.create(
            model="tiny-random",
            messages=ASK,
            tools=[WEATHER],
            max_tokens=300,
            extra_body=forced(text),
            stream=stream,
        )  # type: ignore[call-overload]
        if stream:
            deltas = [c.choices[0].delta for c in out if c.choices]
            thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
            content = "".join(d.content or "" for d in deltas)
            calls = [
                (n, a)
                for n, a, _ in streamed_calls([c for d in deltas for c in d.tool_calls or ()])
            ]
        else:
            message = out.choices[0].message
            thought = message.model_extra["reasoning_content"]
            content = message.content
            calls = [
                (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
            ]
        assert thought == f"Use {call} maybe." and content == "Sure."
        assert calls == [("weather", {"city": "Rome"})]  # the one in the reasoning is no call
    # A schema's output is all answer.
    shaped = client.chat.completions.create(
        model="tiny-random",
        messages=ASK,
        max_tokens=100,
        response_format={"type": "json_object"},
    )
    assert (shaped.choices[0].message.model_extra or {}).get("reasoning_content") is None
    wait_clean(live)
