"""Structured output through the real `openai` client and the native API, on the
bundled model: every JSON answer validates against its schema (many seeds, streaming
and not), regexes and choices are matched, a schema that cannot compile is a 400
naming the field, and a constrained request cancelled mid-stream frees its KV blocks
and its grammar state."""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from kvscope.kernels.guided import closed_objects, live_guides

from .conftest import Live, running_server, sse_events, wait_clean, wait_for, wait_status

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture
def served(backend: str, tmp_path: Path) -> Iterator[tuple[Live, openai.OpenAI]]:
    with (
        running_server(backend, tmp_path, model="bundled") as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        yield live, client


def test_json_schema_answers_validate_for_every_seed(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    for seed in range(6):
        out = client.chat.completions.create(
            model="bundled",
            messages=MESSAGES,
            response_format=FORMAT,
            seed=seed,
            max_tokens=200,
            temperature=1.0,
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
        stream = client.chat.completions.create(
            model="bundled",
            messages=MESSAGES,
            response_format=FORMAT,
            seed=100 + seed,
            max_tokens=200,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        jsonschema.validate(json.loads(text), SCHEMA)
    # n samples each get their own grammar state; completions take vLLM's guided_json.
    out = client.completions.create(
        model="bundled",
        prompt="A person:",
        n=3,
        seed=7,
        max_tokens=200,
        extra_body={"guided_json": SCHEMA},
    )
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    anything = client.chat.completions.create(
        model="bundled",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=200,
        seed=3,
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    wait_clean(live)


def test_an_object_holds_only_the_keys_its_schema_names(
    served: tuple[Live, openai.OpenAI],
) -> None:
    """vLLM's default (xgrammar's strict mode): a schema that lists properties and says
    nothing of others allows no others, nested objects too; `additionalProperties`
    given is kept. A `response_format` of text leaves a `guided_json` beside it."""
    _, client = served
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"result": {"type": "integer"}, "at": inner}}
    for seed in range(4):
        out = client.chat.completions.create(
            model="bundled",
            messages=MESSAGES,
            max_tokens=120,
            seed=seed,
            temperature=1.0,
            extra_body={"guided_json": schema},
        )
        answer = json.loads(out.choices[0].message.content)
        assert set(answer) <= {"result", "at"}
        assert set(answer.get("at", {})) <= {"x"}
    beside_text = client.chat.completions.create(
        model="bundled",
        messages=MESSAGES,
        max_tokens=120,
        seed=1,
        response_format={"type": "text"},
        extra_body={"guided_json": SCHEMA},
    )
    jsonschema.validate(json.loads(beside_text.choices[0].message.content), SCHEMA)
    closed = closed_objects(json.dumps({"$defs": {"a": inner}, "items": [inner], **inner}))
    assert json.loads(closed)["additionalProperties"] is False
    assert json.loads(closed)["$defs"]["a"]["additionalProperties"] is False
    assert json.loads(closed)["items"][0]["additionalProperties"] is False
    opened = {**inner, "additionalProperties": {"type": "string"}}
    assert json.loads(closed_objects(json.dumps(opened))) == opened


def test_regex_and_choice_native_and_openai(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    out = client.completions.create(
        model="bundled",
        prompt="Code:",
        max_tokens=30,
        seed=1,
        extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", out.choices[0].text)
    with live.client() as http:
        job = http.post(
            "/generate",
            json={"prompt": "Answer:", "guided_choice": ["yes", "no", "maybe"], "max_tokens": 10},
        ).json()["id"]
        assert wait_status(http, job)["text"] in ("yes", "no", "maybe")
        body = {"prompt": "n:", "guided_regex": "[0-9]{5}", "max_tokens": 10, "stream": True}
        with http.stream("POST", "/generate", json=body) as response:
            events = list(sse_events(response.iter_lines()))
        assert re.fullmatch("[0-9]{5}", events[-1]["text"])


def test_what_cannot_compile_is_a_400_naming_the_field(served: tuple[Live, openai.OpenAI]) -> None:
    live, client = served
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="bundled", messages=MESSAGES, response_format=bad)
    assert caught.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="bundled", prompt="x", extra_body={"guided_regex": "a(b"})
    assert caught.value.body["param"] == "guided_regex" and "regex" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="bundled", prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["b"]}
        )
    assert caught.value.body["param"] == "guided_choice"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="bundled", messages=MESSAGES, response_format={"type": "json_schema"}
        )
    assert caught.value.body["param"] == "response_format"
    with live.client() as http:
        response = http.post("/generate", json={"prompt": "x", "guided_json": {"type": 3}})
        assert response.status_code == 400 and "guided_json" in response.json()["error"]["message"]
        response = http.post("/v1/completions", json={"prompt": "x", "guided_choice": []})
        assert response.status_code == 400 and response.json()["error"]["param"] == "guided_choice"


GBNF = 'root ::= "SELECT " col " FROM " tbl\ncol ::= "a" | "b"\ntbl ::= "t1" | "t2"'
LARK = 'start: "SELECT " COL " FROM " TBL\nCOL: "a" | "b"\nTBL: "t1" | "t2"'
SQL = r"SELECT [ab] FROM t[12]"


def test_grammars_and_vllms_structured_outputs(served: tuple[Live, openai.OpenAI]) -> None:
    """vLLM's `guided_grammar` (GBNF as vLLM's examples write it, or Lark) and its
    newer `structured_outputs` spelling of every guide."""
    live, client = served
    for grammar in (GBNF, LARK):
        out = client.completions.create(
            model="bundled",
            prompt="SQL:",
            max_tokens=20,
            seed=3,
            extra_body={"guided_grammar": grammar},
        )
        assert re.fullmatch(SQL, out.choices[0].text), out.choices[0].text
    chat = client.chat.completions.create(
        model="bundled",
        messages=MESSAGES,
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": GBNF}},
    )
    assert re.fullmatch(SQL, chat.choices[0].message.content or "")
    shaped = client.chat.completions.create(
        model="bundled",
        messages=MESSAGES,
        max_tokens=100,
        seed=1,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )
    jsonschema.validate(json.loads(shaped.choices[0].message.content or ""), SCHEMA)
    picked = client.completions.create(
        model="bundled",
        prompt="Answer:",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert picked.choices[0].text in ("yes", "no")
    with live.client() as http:
        job = http.post(
            "/generate", json={"prompt": "SQL:", "guided_grammar": LARK, "max_tokens": 20}
        ).json()["id"]
        assert re.fullmatch(SQL, wait_status(http, job)["text"])
        for body, param in (
            ({"guided_grammar": "root ::= ("}, "guided_grammar"),
            ({"structured_outputs": {"grammar": "start: UNDEFINED"}}, "structured_outputs.grammar"),
            ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex"),
            (
                {"guided_regex": "a", "structured_outputs": {"choice": ["b"]}},
                "structured_outputs.choice",
            ),
            ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
        ):
            answer = http.post("/v1/completions", json={"prompt": "x", **body})
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["param"] == param, (body, answer.json())
    wait_clean(live)


def test_cancelling_a_constrained_stream_frees_blocks_and_grammar(
    served: tuple[Live, openai.OpenAI],
) -> None:
    live, client = served
    stream = client.completions.create(
        model="bundled",
        prompt="Letters:",
        max_tokens=900,
        stream=True,
        extra_body={"guided_regex": "[a-z]{2000}"},
    )
    first = next(iter(stream))
    assert live_guides() >= 1
    stream.close()
    with live.client() as http:
        info = wait_status(http, first.id)
        assert info["status"] == "cancelled" and info["cancel_reason"] == "disconnect"
    wait_clean(live)
    assert live.audit_record(first.id)["cancel_reason"] == "disconnect"

    def no_grammar_left() -> bool:
        gc.collect()
        return live_guides() == 0

    wait_for(no_grammar_left, what="every grammar state freed")
