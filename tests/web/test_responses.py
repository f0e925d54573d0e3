"""The Responses API (`/v1/responses`) through the real `openai` client: a response is
the chat route's answer to the same conversation (whole, streamed with every event in
order, in the background); stored responses are retrieved, continued with
`previous_response_id` and deleted; a background response is cancelled at once and
frees its blocks, and so is a stream its client closes or a `DELETE /requests/{id}`
ends; function tools and `text.format` constrain the output; what cannot hold is a
400 (or 404) naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from kvscope import Completion
from kvscope.web.openai.responses.format import ResponseEvents
from kvscope.web.openai.responses.schemas import ResponsesBody
from kvscope.web.openai.responses.view import ResponseView
from kvscope.web.parsers.reasoning import ReasoningParser

from .conftest import Live, bundled_with_template, running_server, wait_clean, wait_for, wait_tokens
from .test_tools import CITY, PAST_CALL, TEMPLATE
from .test_tools import WEATHER as CHAT_WEATHER

GREEDY = {"temperature": 0}
ASK = "Weather in Rome?"
WEATHER = {"type": "function", "name": "weather", "parameters": CITY}


@pytest.fixture
def served(backend: str, tmp_path: Path) -> Iterator[tuple[Live, openai.OpenAI, str]]:
    with (
        running_server(backend, tmp_path) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        yield live, client, client.models.list().data[0].id


def chat(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **options: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, **options)  # type: ignore[call-overload]


def test_a_response_is_the_chat_answer_to_its_conversation(
    served: tuple[Live, openai.OpenAI, str],
) -> None:
    live, client, model = served
    answer = client.responses.create(
        model=model, input=ASK, instructions="Be brief.", max_output_tokens=8, **GREEDY
    )
    same = chat(
        client,
        model,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        max_tokens=8,
        **GREEDY,
    )
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert answer.output_text == same.choices[0].message.content
    assert answer.usage is not None
    assert answer.usage.input_tokens == same.usage.prompt_tokens
    assert answer.usage.output_tokens == same.usage.completion_tokens
    assert answer.usage.total_tokens == same.usage.total_tokens
    if same.choices[0].finish_reason == "length":
        assert answer.status == "incomplete"
        assert answer.incomplete_details and answer.incomplete_details.reason == "max_output_tokens"
    else:
        assert answer.status == "completed" and answer.incomplete_details is None
    assert answer.instructions == "Be brief." and answer.max_output_tokens == 8
    with live.client() as http:
        Response.model_validate(http.get(f"/v1/responses/{answer.id}").json())
    assert answer.temperature == 0 and answer.model == model
    [message] = answer.output
    assert message.type == "message" and message.role == "assistant"
    # Items as the input takes them: the whole conversation again, content parts and the
    # answer's own output item sent back.
    again = client.responses.create(
        model=model,
        input=[
            {"role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
            message.model_dump(),  # type: ignore[list-item]
            {"role": "user", "content": "And Paris?"},
        ],
        max_output_tokens=4,
        **GREEDY,
    )
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": answer.output_text},
        {"role": "user", "content": "And Paris?"},
    ]
    same = chat(client, model, turns, max_tokens=4, **GREEDY)
    assert again.output_text == same.choices[0].message.content
    assert again.usage is not None and again.usage.input_tokens == same.usage.prompt_tokens
    wait_clean(live)


def test_a_streamed_response_sends_every_event_in_order(
    served: tuple[Live, openai.OpenAI, str],
) -> None:
    live, client, model = served
    whole = client.responses.create(
        model=model, input=ASK, max_output_tokens=12, extra_body={"ignore_eos": True}, **GREEDY
    )
    events = list(
        client.responses.create(
            model=model,
            input=ASK,
            max_output_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # 12 tokens: max_output_tokens
    ]
    text = "".join(event.delta for event in deltas)
    assert text == whole.output_text and deltas
    last = events[-1].response  # type: ignore[union-attr]
    assert last.id == events[0].response.id  # type: ignore[union-attr]
    assert last.status == "incomplete" and last.output_text == text
    assert last.usage is not None and last.usage.output_tokens == 12
    assert client.responses.retrieve(last.id).output_text == text  # stored as streamed
    # The client's own accumulator agrees (it checks every item's identity).
    with client.responses.stream(model=model, input=ASK, max_output_tokens=3, **GREEDY) as stream:
        seen = list(stream)
    snapshots = [e.snapshot for e in seen if e.type == "response.output_text.delta"]
    assert snapshots and whole.output_text.startswith(snapshots[-1])
    assert seen[-1].type == "response.incomplete"
    wait_clean(live)


def test_stored_responses_are_retrieved_continued_and_deleted(
    served: tuple[Live, openai.OpenAI, str],
) -> None:
    live, client, model = served
    first = client.responses.create(
        model=model, input=ASK, instructions="Be brief.", max_output_tokens=5, **GREEDY
    )
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(
        model=model,
        input="And Paris?",
        previous_response_id=first.id,
        max_output_tokens=5,
        **GREEDY,
    )
    # The conversation goes on; the instructions do not (OpenAI's rule).
    turns = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And Paris?"},
    ]
    same = chat(client, model, turns, max_tokens=5, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.output_text == same.choices[0].message.content
    assert second.usage is not None and second.usage.input_tokens == same.usage.prompt_tokens
    # The same prompt again: its prefix is found computed.
    again = client.responses.create(
        model=model,
        input="And Paris?",
        previous_response_id=first.id,
        max_output_tokens=5,
        **GREEDY,
    )
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=model, input="x", previous_response_id=first.id)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(model=model, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    wait_clean(live)


def test_a_background_response_runs_on_and_is_cancelled_at_once(
    served: tuple[Live, openai.OpenAI, str],
) -> None:
    live, client, model = served
    quick = client.responses.create(model=model, input=ASK, background=True, max_output_tokens=4)
    assert quick.status in ("queued", "in_progress") and quick.background
    done = wait_for(
        lambda: (r := client.responses.retrieve(quick.id)).status != "in_progress" and r,
        what="the background response to end",
    )
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens <= 4

    long = client.responses.with_raw_response.create(
        model=model,
        input=ASK,
        background=True,
        max_output_tokens=3000,
        extra_body={"ignore_eos": True},
    )
    request_id = long.headers["X-Request-Id"]
    response = long.parse()
    Response.model_validate(json.loads(long.text))  # the openai package's own type, strictly
    with live.client() as http:
        wait_tokens(http, request_id, 2)
        cancelled = client.responses.cancel(response.id)
        assert cancelled.status == "cancelled"
        Response.model_validate(http.get(f"/v1/responses/{response.id}").json())
        assert http.get(f"/requests/{request_id}").json()["status"] == "cancelled"
        # Freed at once, not at the request's end.
        assert live.stats()["live_requests"] == 0 and live.stats()["kv_blocks_in_use"] == 0
        assert client.responses.retrieve(response.id).status == "cancelled"
        assert client.responses.cancel(response.id).status == "cancelled"  # as it ended
        assert live.audit_record(request_id)["cancel_reason"] == "user"

        # Deleting a running one cancels it too.
        other = client.responses.with_raw_response.create(
            model=model,
            input=ASK,
            background=True,
            max_output_tokens=3000,
            extra_body={"ignore_eos": True},
        )
        wait_tokens(http, other.headers["X-Request-Id"], 1)
        client.responses.delete(other.parse().id)
        assert (
            http.get(f"/requests/{other.headers['X-Request-Id']}").json()["status"] == "cancelled"
        )
    wait_clean(live)


def test_a_stream_ends_with_its_request(served: tuple[Live, openai.OpenAI, str]) -> None:
    live, client, model = served
    body = {
        "model": model,
        "input": ASK,
        "stream": True,
        "max_output_tokens": 3000,
        "ignore_eos": True,
    }
    with live.client() as http:
        # Closed by its client: the request is cancelled (reason disconnect).
        with http.stream("POST", "/v1/responses", json=body) as stream:
            request_id = stream.headers["X-Request-Id"]
            for line in stream.iter_lines():
                if line.startswith("event: response.output_text.delta"):
                    break
        wait_clean(live)
        assert live.audit_record(request_id)["cancel_reason"] == "disconnect"
        # Ended by a DELETE: the stream's last event says so.
        with http.stream("POST", "/v1/responses", json=body) as stream:
            request_id = stream.headers["X-Request-Id"]
            wait_tokens(http, request_id, 2)
            assert http.delete(f"/requests/{request_id}").status_code == 200
            data = [
                json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")
            ]
    last = data[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "cancelled"
    assert [d["type"] for d in data[-4:-1]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert data[-2]["item"]["status"] == "incomplete"
    wait_clean(live)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundled_with_template(tmp_path_factory.mktemp("tools"), TEMPLATE)


def test_function_tools_and_text_formats_constrain_the_output(
    backend: str, tmp_path: Path, tool_model: Path
) -> None:
    with (
        running_server(backend, tmp_path, model=str(tool_model)) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        # The tools reach the template, as on the chat route; past calls and their
        # outputs render as the chat route renders them.
        plain = client.responses.create(model="model", input=ASK, max_output_tokens=1)
        tooled = client.responses.create(
            model="model", input=ASK, max_output_tokens=1, tools=[WEATHER]
        )
        assert tooled.usage.input_tokens > plain.usage.input_tokens  # type: ignore[union-attr]
        past = [
            {"role": "user", "content": ASK},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city": "Rome"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
        continued = client.responses.create(
            model="model",
            input=past,
            tools=[WEATHER],
            max_output_tokens=6,
            **GREEDY,  # type: ignore[arg-type]
        )
        same = chat(client, "model", PAST_CALL, tools=[CHAT_WEATHER], max_tokens=6, **GREEDY)
        assert continued.output_text == same.choices[0].message.content
        assert continued.usage.input_tokens == same.usage.prompt_tokens  # type: ignore[union-attr]

        # A named function: one call whose arguments match its schema, streamed too.
        named = client.responses.create(
            model="model",
            input=ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "weather"},
            max_output_tokens=100,
        )
        [call] = named.output
        assert call.type == "function_call" and call.name == "weather"
        assert named.status == "completed" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), CITY)
        with client.responses.stream(
            model="model",
            input=ASK,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "weather"},
            max_output_tokens=100,
            **GREEDY,
        ) as stream:
            pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
            final = stream.get_final_response()
        [streamed] = final.output
        assert streamed.type == "function_call" and streamed.arguments == "".join(pieces)
        jsonschema.validate(json.loads(streamed.arguments), CITY)
        assert client.responses.retrieve(final.id).output[0].call_id == streamed.call_id  # type: ignore[union-attr]

        # required: one call or more, each of a given tool.
        required = client.responses.create(
            model="model",
            input=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=200,
            extra_body={"seed": 1},
        )  # type: ignore[call-overload]
        assert required.status == "completed" and required.output
        for item in required.output:
            assert item.type == "function_call" and item.name == "weather"
            jsonschema.validate(json.loads(item.arguments), CITY)

        # text.format: JSON matching the schema, or any JSON object.
        shaped = client.responses.create(
            model="model",
            input=ASK,
            text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
            max_output_tokens=100,
        )
        jsonschema.validate(json.loads(shaped.output_text), CITY)
        assert shaped.text.format.type == "json_schema"  # type: ignore[union-attr]
        anything = client.responses.create(
            model="model",
            input=ASK,
            text={"format": {"type": "json_object"}},
            max_output_tokens=100,
        )
        if anything.status == "completed":
            assert isinstance(json.loads(anything.output_text), dict)
        wait_clean(live)


BAD = [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"truncation": "middle"}, 400, "truncation"),
    ({"background": True, "store": False}, 400, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "clock"}},
        400,
        "tool_choice",
    ),
    (
        {
            "tools": [WEATHER],
            "tool_choice": "required",
            "text": {"format": {"type": "json_object"}},
        },
        400,
        "tool_choice",
    ),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"temperature": 3}, 400, "temperature"),
    ({"previous_response_id": "resp_nothing"}, 404, "previous_response_id"),
    ({"model": "another"}, 404, "model"),
]
BAD_INPUT = [
    ([{"type": "computer_call", "id": "c"}], "input.0"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.0"),
    ([{"role": "robot", "content": "hi"}], "input.0"),
]


def test_what_cannot_hold_is_refused_naming_its_field(
    served: tuple[Live, openai.OpenAI, str],
) -> None:
    live, client, model = served
    with live.client() as http:
        for extra, status, param in BAD:
            answer = http.post("/v1/responses", json={"model": model, "input": ASK, **extra})
            assert answer.status_code == status, (extra, answer.text)
            assert answer.json()["error"]["param"] == param, (extra, answer.text)
        for items, param in BAD_INPUT:
            answer = http.post("/v1/responses", json={"model": model, "input": items})
            assert answer.status_code == 400, (items, answer.text)
            assert answer.json()["error"]["param"].startswith(param), (items, answer.text)
        done = client.responses.create(model=model, input=ASK, max_output_tokens=1)
        refused = http.post(f"/v1/responses/{done.id}/cancel")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_id"
        # vLLM's words, which its tests match (responses/test_stateful.py).
        assert refused.json()["error"]["message"].startswith("Cannot cancel a synchronous response")
        background = http.post(
            "/v1/responses", json={"model": model, "input": ASK, "background": True, "store": False}
        )
        assert "background can only be used when `store` is true" in background.text
        again = http.get(f"/v1/responses/{done.id}", params={"stream": "true"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
        for method in ("GET", "DELETE"):
            missing = http.request(method, "/v1/responses/resp_nothing")
            assert missing.status_code == 404
            assert (
                missing.json()["error"]["message"] == "Response with id 'resp_nothing' not found."
            )
        assert http.post("/v1/responses/resp_nothing/cancel").status_code == 404
    wait_clean(live)


def test_a_key_sees_only_its_own_responses(backend: str, tmp_path: Path) -> None:
    with running_server(backend, tmp_path, api_keys=("alpha", "beta")) as live:
        clients = [
            openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=60)
            for key in ("alpha", "beta")
        ]
        alpha, beta = clients
        model = alpha.models.list().data[0].id
        mine = alpha.responses.create(
            model=model,
            input=ASK,
            background=True,
            max_output_tokens=3000,
            extra_body={"ignore_eos": True},
        )
        for call in (
            lambda: beta.responses.retrieve(mine.id),
            lambda: beta.responses.cancel(mine.id),
            lambda: beta.responses.delete(mine.id),
            lambda: beta.responses.create(model=model, input="x", previous_response_id=mine.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert alpha.responses.cancel(mine.id).status == "cancelled"
        for client in clients:
            client.close()
        wait_clean(live)


def test_the_openapi_document_shows_the_routes(served: tuple[Live, openai.OpenAI, str]) -> None:
    live, _client, _model = served
    with live.client() as http:
        paths = http.get("/openapi.json").json()["paths"]
    assert "post" in paths["/v1/responses"]
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert "post" in paths["/v1/responses/{response_id}/cancel"]
    assert "get" in paths["/v1/responses/{response_id}/input_items"]


STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def parsed_events(stream: bytes) -> list[dict[str, Any]]:
    """The events of SSE bytes, each checked against the openai package's own types
    (its `event:` line names its type)."""
    events = []
    for message in stream.decode().split("\n\n"):
        if not message:
            continue
        kind, data = message.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        STREAM_EVENT.validate_python(event)
        events.append(event)
    return events


def test_under_auto_the_text_streams_up_to_a_call_and_then_the_call() -> None:
    """`tool_choice: auto` on a stream, fed the text a model writes: `ResponseEvents`
    sends the content as it comes, holds back what could open a `<tool_call>`, then
    sends the call as a `function_call` item once its name is whole, its arguments as
    they come; every event and the final response match the openai package's types."""
    body = ResponsesBody.model_validate({"input": ASK, "tools": [WEATHER]})
    view = ResponseView("resp_abc", body, "model", {"temperature": 1.0, "top_p": 1.0})
    events = ResponseEvents(view)
    pieces = [
        "Sure",
        ". <tool",
        '_call>{"name": "weather", ',
        '"arguments": {"city"',
        ': "Rome"}}',
        "</tool_call>",
    ]
    stream = events.opening()
    for index, piece in enumerate(pieces):
        stream += events.feed(piece, index == 0)
    text = "".join(pieces)
    result = Completion(
        id="req-1",
        text=text,
        token_ids=tuple(range(len(pieces))),
        finish_reason="stop",
        prompt_tokens=7,
    )
    stream += events.closing(result)
    parsed = parsed_events(stream)
    deltas = [e["delta"] for e in parsed if e["type"] == "response.output_text.delta"]
    assert deltas == ["Sure", ". "]  # "<tool" was held back, then the tag came
    kinds = [e["type"] for e in parsed]
    added = [i for i, e in enumerate(parsed) if e["type"] == "response.output_item.added"]
    # The message is done before the call's item opens, as soon as its name is whole
    # (in the fourth piece), and its arguments come as the model writes them.
    assert kinds.index("response.output_item.done") < added[1]
    arguments = [e for e in parsed if e["type"] == "response.function_call_arguments.delta"]
    assert [e["delta"] for e in arguments] == ['{"city"', ': "Rome"}']
    assert added[1] < parsed.index(arguments[0])
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    final = Response.model_validate(parsed[-1]["response"])
    assert parsed[-1]["type"] == "response.completed" and final.status == "completed"
    message, call = final.output
    assert message.type == "message" and message.content[0].text == "Sure. "  # type: ignore[union-attr]
    assert call.type == "function_call" and call.name == "weather"
    assert json.loads(call.arguments) == {"city": "Rome"}
    # The stored response is the same one, its items' ids too.
    stored = view.final(result)
    assert [item["id"] for item in stored["output"]] == [message.id, call.id]
    assert stored["output"][1]["call_id"] == call.call_id
    Response.model_validate(stored)


def test_the_store_forgets_the_oldest_past_its_limits(backend: str, tmp_path: Path) -> None:
    with (
        running_server(backend, tmp_path, stored_responses=2, stored_responses_bytes=4000) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        model = client.models.list().data[0].id
        ids = [
            client.responses.create(model=model, input=f"{i}", max_output_tokens=1).id
            for i in range(3)
        ]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
        # One long conversation takes the room of both.
        long = client.responses.create(model=model, input="x" * 3960, max_output_tokens=1)
        for forgotten in ids[1:]:
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(forgotten)
        assert client.responses.retrieve(long.id).id == long.id
        wait_clean(live)


def test_a_stored_responses_input_items_are_listed_a_page_at_a_time(
    served: tuple[Live, openai.OpenAI, str],
) -> None:
    live, client, model = served
    given = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks."}], "id": "msg_mine"},
    ]
    answer = client.responses.create(model=model, input=given, max_output_tokens=1)  # type: ignore[arg-type]
    listed = list(client.responses.input_items.list(answer.id, order="asc"))
    assert [item.type for item in listed] == [
        "message",
        "function_call",
        "function_call_output",
        "message",
        "message",
    ]
    assert listed[0].content[0].text == "Weather?"  # type: ignore[union-attr]
    assert listed[1].call_id == "call_1" and listed[2].output == "sunny"  # type: ignore[union-attr]
    assert listed[3].role == "assistant" and listed[4].id == "msg_mine"  # type: ignore[union-attr]
    assert len({item.id for item in listed}) == 5
    with live.client() as http:
        # Newest first unless asked; two pages of three and two, each the openai
        # package's type.
        first = http.get(f"/v1/responses/{answer.id}/input_items", params={"limit": 3}).json()
        ResponseItemList.model_validate(first)
        assert [item["id"] for item in first["data"]] == [item.id for item in listed[::-1][:3]]
        assert first["has_more"] and first["last_id"] == listed[2].id
        rest = http.get(
            f"/v1/responses/{answer.id}/input_items",
            params={"limit": 3, "after": first["last_id"]},
        ).json()
        assert [item["id"] for item in rest["data"]] == [listed[1].id, listed[0].id]
        assert not rest["has_more"]
        text = client.responses.create(model=model, input="Hi", max_output_tokens=1)
        [only] = http.get(f"/v1/responses/{text.id}/input_items").json()["data"]
        assert only["role"] == "user" and only["content"] == [{"type": "input_text", "text": "Hi"}]
        for query, param in (
            ({"limit": 0}, "limit"),
            ({"order": "up"}, "order"),
            ({"after": "msg_nothing"}, "after"),
            ({"include": "x"}, "include"),
        ):
            refused = http.get(f"/v1/responses/{answer.id}/input_items", params=query)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    wait_clean(live)


def assert_alike(entries: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same tokens and alternatives, their log-probabilities equal up to the float
    noise of a batch or a prefix-cache hit (a few 1e-6)."""

    def tokens(entry: dict[str, Any]) -> list[str]:
        return [entry["token"], *(top["token"] for top in entry["top_logprobs"])]

    def values(entry: dict[str, Any]) -> list[float]:
        return [entry["logprob"], *(top["logprob"] for top in entry["top_logprobs"])]

    assert list(map(tokens, entries)) == list(map(tokens, expected))
    flat = [v for entry in entries for v in values(entry)]
    assert flat == pytest.approx([v for entry in expected for v in values(entry)], abs=1e-4)


def test_the_output_texts_logprobs_are_chats(served: tuple[Live, openai.OpenAI, str]) -> None:
    live, client, model = served
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    answer = client.responses.create(model=model, input=ASK, max_output_tokens=6, **asked, **GREEDY)  # type: ignore[call-overload]
    same = chat(
        client,
        model,
        [{"role": "user", "content": ASK}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    expected = [entry.model_dump() for entry in same.choices[0].logprobs.content]
    [part] = answer.output[0].content  # type: ignore[union-attr]
    assert_alike([entry.model_dump() for entry in part.logprobs], expected)  # type: ignore[union-attr]
    assert answer.top_logprobs == 2 and len(expected) == answer.usage.output_tokens  # type: ignore[union-attr]
    with live.client() as http:
        body = {"model": model, "input": ASK, "max_output_tokens": 6, "stream": True}
        with http.stream("POST", "/v1/responses", json={**body, **asked, **GREEDY}) as stream:
            data = parsed_events(b"".join(f"{line}\n".encode() for line in stream.iter_lines()))
        streamed = [e for e in data if e["type"] == "response.output_text.delta"]
        assert_alike([entry for e in streamed for entry in e["logprobs"]], expected)
        done = next(e for e in data if e["type"] == "response.output_text.done")
        assert_alike(done["logprobs"], expected)
        for extra, param in (
            ({"top_logprobs": 2}, "top_logprobs"),
            ({**asked, "tools": [WEATHER]}, "include"),
            ({"include": ["reasoning.encrypted_content"]}, "include.0"),
        ):
            refused = http.post("/v1/responses", json={"model": model, "input": ASK, **extra})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    wait_clean(live)


def test_a_reasoning_item_comes_before_the_answer() -> None:
    """With a reasoning parser (`qwen3`), fed what a thinking model writes, a stream's
    events give the reasoning its own item, done before the message opens, and the
    whole response the same items; each event matches the openai package's types."""
    body = ResponsesBody.model_validate({"input": ASK})
    view = ResponseView("resp_abc", body, "model", {}, reasoning=ReasoningParser("qwen3"))
    events = ResponseEvents(view)
    pieces = ["<thi", "nk>Two and", " two.</th", "ink>It is", " 4."]
    stream = events.opening()
    for index, piece in enumerate(pieces):
        stream += events.feed(piece, index == 0)
    result = Completion(
        id="req-1", text="".join(pieces), token_ids=(1,) * 5, finish_reason="stop", prompt_tokens=3
    )
    stream += events.closing(result)
    parsed = parsed_events(stream)
    kinds = [e["type"] for e in parsed]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    thought = "".join(e["delta"] for e in parsed if e["type"] == "response.reasoning_text.delta")
    assert thought == "Two and two."
    final = Response.model_validate(parsed[-1]["response"])
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Two and two."  # type: ignore[union-attr,index]
    assert final.output_text == "It is 4."
    whole = Response.model_validate(view.final(result))
    assert whole.output == final.output


def test_a_reasoning_item_sent_back_is_dropped(served: tuple[Live, openai.OpenAI, str]) -> None:
    live, client, model = served
    turn = [{"role": "user", "content": ASK}]
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Let me think."}],
    }
    plain = client.responses.create(model=model, input=turn, max_output_tokens=1)  # type: ignore[arg-type]
    sent_back = client.responses.create(model=model, input=[*turn, thought], max_output_tokens=1)  # type: ignore[list-item]
    assert sent_back.usage.input_tokens == plain.usage.input_tokens  # type: ignore[union-attr]
    listed = client.responses.input_items.list(sent_back.id, order="asc")
    assert [item.type for item in listed] == ["message", "reasoning"]
    wait_clean(live)


def test_a_background_stream_is_left_and_taken_up_again(
    served: tuple[Live, openai.OpenAI, str],
) -> None:
    """Closing a background response's stream cancels nothing; `GET ?stream=true`
    sends its events again after `starting_after`, the same events, while it runs; its
    cancel ends that stream too."""
    live, client, model = served
    body = {
        "model": model,
        "input": ASK,
        "background": True,
        "stream": True,
        "max_output_tokens": 3000,
        "ignore_eos": True,
        **GREEDY,
    }
    with live.client() as http:
        seen: list[dict[str, Any]] = []
        with http.stream("POST", "/v1/responses", json=body) as stream:
            request_id = stream.headers["X-Request-Id"]
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                if sum(e["type"] == "response.output_text.delta" for e in seen) == 3:
                    break
        response_id = seen[0]["response"]["id"]
        wait_tokens(http, request_id, 6)  # it ran on, unread
        assert http.get(f"/requests/{request_id}").json()["status"] == "running"
        last = seen[-1]["sequence_number"]
        path = f"/v1/responses/{response_id}"
        with http.stream("GET", path, params={"stream": "true", "starting_after": last}) as again:
            first = None
            resumed: list[dict[str, Any]] = []
            for line in again.iter_lines():
                if not line.startswith("data: "):
                    continue
                resumed.append(json.loads(line[6:]))
                if first is None:
                    first = resumed[0]
                    cancelled = client.responses.cancel(response_id)
                    assert cancelled.status == "cancelled"
        assert first is not None and first["sequence_number"] == last + 1
        assert [e["sequence_number"] for e in resumed] == list(
            range(last + 1, last + 1 + len(resumed))
        )
        final = resumed[-1]["response"]
        assert resumed[-1]["type"] == "response.incomplete" and final["status"] == "cancelled"
        text = "".join(
            e["delta"] for e in seen + resumed if e["type"] == "response.output_text.delta"
        )
        assert final["output"][0]["content"][0]["text"] == text
        ended = http.get(path, params={"stream": "true"})
        assert ended.status_code == 400 and ended.json()["error"]["param"] == "stream"
    wait_clean(live)


TURNS = [
    *(
        turn
        for i in range(4)
        for turn in (
            {"role": "user", "content": f"Question number {i}, asked at length."},
            {"role": "assistant", "content": f"Answer number {i}, given at length."},
        )
    ),
    {"role": "user", "content": "And the last one?"},
]


def test_truncation_auto_drops_the_oldest_turns(backend: str, tmp_path: Path) -> None:
    """A conversation too long for the context (96 tokens here): refused as it is;
    with `truncation: auto` its oldest turns go, each with its answer, until the
    answer has room, and the prompt is the chat route's of the turns kept."""
    turns = TURNS
    with (
        running_server(backend, tmp_path, max_model_len=96) as live,
        live.client() as http,
    ):
        body = {"model": "tiny-random", "input": turns, "max_output_tokens": 8}
        refused = http.post("/v1/responses", json=body)
        assert refused.status_code == 400, refused.text
        kept = http.post("/v1/responses", json={**body, "truncation": "auto"}).json()
        assert kept["truncation"] == "auto" and kept["status"] in ("completed", "incomplete")
        used = kept["usage"]["input_tokens"]
        assert used + 8 <= 96
        tails = {
            len(turns) - start: http.post("/tokenize", json={"messages": turns[start:]}).json()
            for start in range(0, len(turns), 2)
        }
        fitting = [n for n, t in tails.items() if t["count"] + 8 <= 96]
        assert used == tails[max(fitting)]["count"]  # as many turns as fit, no fewer
        assert max(fitting) < len(turns)
        alone = {**body, "input": "x" * 200, "truncation": "auto"}
        too_long = http.post("/v1/responses", json=alone)
        assert too_long.status_code == 400  # one message that does not fit: no turn to drop
        wait_clean(live)


def test_truncation_auto_keeps_a_chat_within_max_prompt_bytes(backend: str, tmp_path: Path) -> None:
    """The byte limit counts a chat's texts before rendering: `truncation: auto` drops
    the oldest turns until they fit it too."""
    with (
        running_server(backend, tmp_path, max_prompt_bytes=150) as live,
        live.client() as http,
    ):
        body = {"model": "tiny-random", "input": TURNS, "max_output_tokens": 2}
        refused = http.post("/v1/responses", json=body)
        assert refused.status_code == 400 and "max_prompt_bytes" in refused.text
        kept = http.post("/v1/responses", json={**body, "truncation": "auto"})
        assert kept.status_code == 200, kept.text
        sizes = {
            start: sum(len(t["content"]) for t in TURNS[start:])
            for start in range(0, len(TURNS), 2)
        }
        start = min(s for s, size in sizes.items() if size <= 150)
        counted = http.post("/tokenize", json={"messages": TURNS[start:]}).json()["count"]
        assert kept.json()["usage"]["input_tokens"] == counted
        wait_clean(live)
