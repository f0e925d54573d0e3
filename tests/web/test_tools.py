"""Tool calling through the real `openai` client, on a copy of the bundled model whose
chat template shows the tools and renders an assistant's calls in the Hermes format:
the tools reach the template (not with `tool_choice: none`), a named choice calls its
function with arguments that match its schema, `required` gives one call or more, `auto`
finds `<tool_call>` blocks (forced here with a regex, since the model is random), all
of it streamed too (a named function's arguments as they come); what cannot hold is a
400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from kvscope.web.parsers.tool_calls import HERMES, HeldContent

from .conftest import Live, bundled_with_template, running_server, wait_clean

TEMPLATE = (
    "{{ bos_token }}{% if tools %}system: tools {{ tools | tojson }}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY}}
TIME = {
    "type": "function",
    "function": {
        "name": "clock",
        "description": "the time in a city",
        "parameters": {**CITY, "properties": {"city": {"enum": ["Oslo"]}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Rome?"}]


def streamed_calls(parts: list[Any]) -> list[tuple[str, Any, int]]:
    """A stream's tool-call deltas as calls, by index: each one's name and parsed
    arguments, and how many deltas its arguments came in. Checks OpenAI's shape: a
    call's first delta has its id, type and name, the others only more arguments."""
    calls: dict[int, list[Any]] = {}
    for part in parts:
        if part.index not in calls:
            assert part.id and part.type == "function" and part.function.name, part
            calls[part.index] = [part.function.name, part.function.arguments or "", 0]
        else:
            assert part.id is None and part.function.name is None, part
            calls[part.index][1] += part.function.arguments
            calls[part.index][2] += 1
    assert sorted(calls) == list(range(len(calls)))
    return [(name, json.loads(args), pieces) for name, args, pieces in calls.values()]


#: A conversation in which the assistant called `weather` and got its output.
PAST_CALL = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
FORCED_CALL = 'Sure.<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundled_with_template(tmp_path_factory.mktemp("tools"), TEMPLATE)


@pytest.fixture
def served(backend: str, tmp_path: Path, tool_model: Path) -> Iterator[tuple[Live, openai.OpenAI]]:
    with (
        running_server(backend, tmp_path, model=str(tool_model)) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        yield live, client


def rendered(live: Live, **body: object) -> str:
    with live.client() as http:
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_tools_and_past_calls_reach_the_template(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    text = rendered(live, messages=PAST_CALL, tools=[WEATHER])
    assert text.startswith('system: tools [{"type": "function", "function": {"name": "weather"')
    # The call's arguments reach the template as an object, not as JSON text.
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    assert text.endswith("tool: sunny\nassistant:")
    plain = client.chat.completions.create(model="model", messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(
        model="model", messages=ASK, max_tokens=1, tools=[WEATHER]
    )
    without = client.chat.completions.create(
        model="model", messages=ASK, max_tokens=1, tools=[WEATHER], tool_choice="none"
    )
    assert without.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    wait_clean(live)


def test_a_named_choice_calls_its_function(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    named = {"type": "function", "function": {"name": "weather"}}
    for seed in range(3):
        out = client.chat.completions.create(
            model="model",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=named,
            seed=seed,
            max_tokens=200,
            temperature=1.0,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), CITY)
    stream = client.chat.completions.create(
        model="model",
        messages=ASK,
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=200,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    parts = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    # Streamed as they come: the first part names the call, the others add arguments.
    assert len(parts) > 2 and all(part.index == 0 for part in parts)
    assert parts[0].id and parts[0].function.name == "weather"
    assert all(part.id is None and part.function.name is None for part in parts[1:])
    jsonschema.validate(json.loads("".join(p.function.arguments for p in parts)), CITY)
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_clean(live)


def test_required_gives_a_call_of_a_given_tool(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    for seed in range(3):
        out = client.chat.completions.create(
            model="model",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            max_tokens=300,
            temperature=1.0,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        schema = CITY if call.function.name == "weather" else TIME["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    wait_clean(live)


def test_auto_finds_hermes_blocks(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    forced = {"guided_regex": re.escape(FORCED_CALL)}
    out = client.chat.completions.create(
        model="model", messages=ASK, tools=[WEATHER], max_tokens=200, extra_body=forced
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    stream = client.chat.completions.create(
        model="model", messages=ASK, tools=[WEATHER], max_tokens=200, extra_body=forced, stream=True
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == "Sure."
    calls_at = [i for i, d in enumerate(deltas) if d.delta.tool_calls]
    # The content went out as it came, before the call; the call's name once whole,
    # then its arguments as the model wrote them, over several deltas.
    assert [i for i, d in enumerate(deltas) if d.delta.content] < calls_at
    [(name, arguments, pieces)] = streamed_calls(
        [call for d in deltas for call in d.delta.tool_calls or ()]
    )
    assert (name, arguments) == ("weather", {"city": "Rome"}) and pieces > 1
    assert deltas[-1].finish_reason == "tool_calls"
    no_call = client.chat.completions.create(
        model="model",
        messages=ASK,
        tools=[WEATHER],
        max_tokens=20,
        extra_body={"guided_regex": "[a-z]{5}"},
    )
    assert no_call.choices[0].finish_reason == "stop"
    assert re.fullmatch("[a-z]{5}", no_call.choices[0].message.content)
    assert not no_call.choices[0].message.tool_calls
    plain_stream = client.chat.completions.create(
        model="model",
        messages=ASK,
        tools=[WEATHER],
        max_tokens=20,
        stream=True,
        extra_body={"guided_regex": "[a-z]{5}"},
    )
    pieces = [c.choices[0].delta.content for c in plain_stream if c.choices]
    assert re.fullmatch("[a-z]{5}", "".join(p or "" for p in pieces))
    assert len([p for p in pieces if p]) > 1  # streamed, not held to the end
    wait_clean(live)


def test_content_is_held_only_where_a_call_may_start() -> None:
    held = HeldContent(HERMES)
    assert held.feed("Let me check. <to") == "Let me check. "
    assert held.feed("ol") == ""
    assert held.feed("s and more") == "<tools and more"  # not a tag after all
    assert held.feed(' <tool_call>{"name"') == " "
    assert held.feed(': "f"}</tool_call> after') == ""
    text = held.text
    assert held.rest(text) == ""  # the content before the block is all out
    broken = HeldContent(HERMES)
    assert broken.feed("a<tool_call>not json") == "a"
    assert broken.rest(broken.text) == "<tool_call>not json"  # no call: all content


def test_what_cannot_hold_is_refused_by_name(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    named = {"type": "function", "function": {"name": "weather"}}
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {**named, "function": {"name": "clock"}}},
            "tool_choice",
        ),
        (
            {"tools": [WEATHER], "tool_choice": named, "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "stream": True, "logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="model", messages=ASK, max_tokens=1, **fields)
        assert (caught.value.body["param"] or "").split(".")[0] == param, (fields, caught.value)
    wait_clean(live)
