"""A grammar or schema deep enough to overflow the native compiler's stack used to kill
the server (SIGSEGV: every stream cut). Every route that takes a guide now answers it
with a 400 naming the budget it is over, while a stream beside it runs to its end."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from tests.guide_shapes import (
    lark_chain,
    nested_array_schema,
    nested_parens_grammar,
    nested_regex,
    schema_ref_chain,
)

from .conftest import Live, running_server, sse_events

MODEL = "bundled"
ASK = [{"role": "user", "content": "Answer."}]

#: The crashes as found (a 78 KB chain of 3,000 rules, a 75 KB chain of 1,000 `$defs`)
#: and the small deep nestings, each with the budget that refuses it.
GRAMMARS = [
    (lark_chain(3000), "max_grammar_rules"),
    (nested_parens_grammar(101), "max_guide_nesting"),
]
SCHEMAS = [
    (schema_ref_chain(1000), "max_schema_refs"),
    (nested_array_schema(100), "max_guide_nesting"),
]
REGEXES = [(nested_regex(101), "max_guide_nesting")]


def grammar_bodies(grammar: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "/generate", {"prompt": "x", "guided_grammar": grammar}
    yield "/v1/completions", {"model": MODEL, "prompt": "x", "guided_grammar": grammar}
    outputs = {"structured_outputs": {"grammar": grammar}}
    yield "/v1/completions", {"model": MODEL, "prompt": "x", **outputs}
    yield "/v1/chat/completions", {"model": MODEL, "messages": ASK, **outputs}
    yield "/invocations", {"prompt": "x", **outputs}


def regex_bodies(regex: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "/generate", {"prompt": "x", "guided_regex": regex}
    yield "/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": regex}}


def schema_bodies(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "/generate", {"prompt": "x", "guided_json": schema}
    yield "/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": schema}
    shaped = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    yield "/v1/chat/completions", {"model": MODEL, "messages": ASK, "response_format": shaped}
    tool = {"type": "function", "function": {"name": "deep", "parameters": schema}}
    named = {"type": "function", "function": {"name": "deep"}}
    chat_tools = {"model": MODEL, "messages": ASK, "tools": [tool], "tool_choice": named}
    yield "/v1/chat/completions", chat_tools
    text = {"format": {"type": "json_schema", "name": "deep", "schema": schema}}
    yield "/v1/responses", {"model": MODEL, "input": "Answer.", "text": text}
    yield "/invocations", {"messages": ASK, "response_format": shaped}


def every_body() -> Iterator[tuple[str, dict[str, Any], str]]:
    for grammar, budget in GRAMMARS:
        yield from ((path, body, budget) for path, body in grammar_bodies(grammar))
    for regex, budget in REGEXES:
        yield from ((path, body, budget) for path, body in regex_bodies(regex))
    for schema, budget in SCHEMAS:
        yield from ((path, body, budget) for path, body in schema_bodies(schema))


@pytest.fixture
def live(backend: str, tmp_path: Path) -> Iterator[Live]:
    with running_server(backend, tmp_path, model=MODEL) as running:
        yield running


class Beside:
    """A streamed `/generate` of `tokens` tokens in a thread of its own: its events."""

    def __init__(self, live: Live, tokens: int) -> None:
        self.events: list[Any] = []
        self.started = threading.Event()
        body = {"prompt": "beside", "stream": True, "max_tokens": tokens, "ignore_eos": True}
        self._thread = threading.Thread(target=self._run, args=(live, body))
        self._thread.start()

    def _run(self, live: Live, body: dict[str, Any]) -> None:
        try:
            with live.client() as http, http.stream("POST", "/generate", json=body) as response:
                for event in sse_events(response.iter_lines()):
                    self.events.append(event)
                    self.started.set()
        finally:
            self.started.set()

    def result(self) -> list[Any]:
        self._thread.join(timeout=120)
        return self.events


def test_every_guided_route_refuses_a_deep_guide_and_the_server_keeps_serving(
    live: Live,
) -> None:
    beside = Beside(live, tokens=120)
    assert beside.started.wait(60)
    with live.client() as http:
        for path, body, budget in every_body():
            response = http.post(path, json=body)
            assert response.status_code == 400, (path, response.text[:300])
            message = response.json()["error"]["message"]
            assert "structured-output budget" in message and budget in message, (path, message)
        with connect(live.ws_url + "/ws/generate") as ws:
            for guide, budget in [("guided_grammar", GRAMMARS[0]), ("guided_json", SCHEMAS[0])]:
                ws.send(json.dumps({"type": "generate", "prompt": "x", guide: budget[0]}))
                error = json.loads(ws.recv(timeout=60))
                assert error["type"] == "error" and budget[1] in error["error"]["message"]
        normal = http.post(
            "/generate", json={"prompt": "x", "max_tokens": 4, "guided_regex": "[ab]{4}"}
        )
        assert normal.status_code == 202
    events = beside.result()
    done = events[-1] if events else {}
    assert done["type"] == "done" and done["finish_reason"] == "length", events[-3:]
    assert done["completion_tokens"] == 120


def test_a_guide_at_the_budget_is_served(live: Live) -> None:
    """What the budget admits compiles and constrains: a 900-rule chain's output."""
    with live.client() as http:
        body = {
            "prompt": "x",
            "max_tokens": 40,
            "temperature": 0,
            "guided_grammar": lark_chain(900),
        }
        response = http.post("/generate", json={**body, "stream": True})
        assert response.status_code == 200
        events = list(sse_events(response.iter_lines()))
    text = "".join(e["text"] for e in events if e["type"] == "token")
    chain = "".join(f"x{i}" for i in range(900)) + "z"
    assert text == "y" or (text and chain.startswith(text)), text


# -- fuzzing ------------------------------------------------------------------------------

LEAF_REGEX = st.sampled_from(["a", "[0-9]", "b?", "\\.", "[^)]"])
REGEX = st.recursive(
    LEAF_REGEX,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda parts: f"({'|'.join(parts)})"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{1,3}"])).map(
            lambda p: f"({p[0]}){p[1]}"
        ),
    ),
    max_leaves=60,
)
LARK_EXPR = st.recursive(
    st.sampled_from(['"a"', '"b"', "/[0-9]+/", '"("']),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map(" ".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda parts: f"({' | '.join(parts)})"),
        inner.map(lambda part: f"[{part}]"),
        st.tuples(inner, st.sampled_from(["*", "+", "?"])).map(lambda p: f"({p[0]}){p[1]}"),
    ),
    max_leaves=60,
)
SCHEMA = st.recursive(
    st.sampled_from(
        [{"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b"]}, {"type": "null"}]
    ),
    lambda inner: st.one_of(
        inner.map(lambda items: {"type": "array", "items": items, "maxItems": 2}),
        inner.map(lambda value: {"type": "object", "properties": {"a": value}, "required": ["a"]}),
        st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=60,
)
#: Each shape's generator of guides at a depth, and the depth it can grow to.
DEEP = [
    (lambda n: ("grammar", lark_chain(n)), 4000),
    (lambda n: ("grammar", nested_parens_grammar(n)), 300),
    (lambda n: ("regex", nested_regex(n)), 400),
    (lambda n: ("regex", "(a|" * n + "b" + ")" * n), 400),
    (lambda n: ("schema", schema_ref_chain(n)), 1500),
    (lambda n: ("schema", nested_array_schema(n)), 300),
]
#: Depths as a share of each shape's largest, from past what once crashed to shallow
#: (hypothesis draws the first of a list most often).
SHARES = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.25, 0.1, 0.02, 0.005]
DEEP_GUIDES = st.tuples(st.sampled_from(DEEP), st.sampled_from(SHARES)).map(
    lambda pick: pick[0][0](max(1, int(pick[0][1] * pick[1])))  # type: ignore[operator]
)
GUIDES = st.one_of(
    DEEP_GUIDES,
    DEEP_GUIDES,  # twice: as likely as the three random kinds together
    REGEX.map(lambda regex: ("regex", regex)),
    LARK_EXPR.map(lambda expr: ("grammar", f"start: {expr}")),
    SCHEMA.map(lambda schema: ("schema", schema)),
)
BODIES = {"grammar": grammar_bodies, "regex": regex_bodies, "schema": schema_bodies}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with running_server("asyncio", tmp_path_factory.mktemp("fuzz"), model=MODEL) as running:
        yield running


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(guide=GUIDES, data=st.data())
def test_generated_guides_of_growing_depth_are_answered_and_the_server_lives(
    fuzzed: Live, guide: tuple[str, Any], data: st.DataObject
) -> None:
    kind, source = guide
    path, body = data.draw(st.sampled_from(list(BODIES[kind](source))))
    limit = {"max_output_tokens": 16} if path == "/v1/responses" else {"max_tokens": 2}
    with fuzzed.client() as http:
        response = http.post(path, json={**body, **limit})
        assert response.status_code in (200, 202, 400), (path, response.text[:300])
        if response.status_code == 400:
            assert response.json()["error"]["message"]
        assert http.get("/health").status_code == 200
