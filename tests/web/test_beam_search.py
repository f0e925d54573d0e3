"""vLLM's `use_beam_search` on the OpenAI routes, against `transformers`' beam search,
through the `openai` client and raw sockets on a real server.

`n` is the beam width; the choices are the beams, best first. It is not streamed, and
a sampling field it would not apply is a 400 naming it. A client that goes away
mid-search cancels the step's requests and frees their blocks.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.models.conftest import build_checkpoint
from tests.models.test_beam_search import hf_beams

from .conftest import Live, running_server, wait_clean, wait_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [0, 45, 67, 89, 45, 67, 89, 45, 67]  # BOS and a repeated pattern
SEARCH = {"use_beam_search": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("beams") / "llama")


@pytest.fixture
def served(backend: str, tmp_path: Path, checkpoint: Path) -> Iterator[tuple[Live, openai.OpenAI]]:
    with (
        running_server(backend, tmp_path, model=str(checkpoint)) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
    ):
        yield live, client


def test_the_choices_are_the_beams_of_transformers(
    served: tuple[Live, openai.OpenAI], checkpoint: Path
) -> None:
    live, client = served
    hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    out = client.completions.create(
        model=checkpoint.name, prompt=PROMPT, max_tokens=6, n=3, extra_body=SEARCH
    )
    expected = [tokenizer.decode(beam) for beam in hf_beams(hf, PROMPT, 3, 6)]
    assert [choice.text for choice in out.choices] == expected
    assert [choice.index for choice in out.choices] == [0, 1, 2]
    assert {choice.finish_reason for choice in out.choices} == {"length"}
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model=checkpoint.name,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=4,
        n=2,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    assert len(chat.choices) == 2 and all(c.message.role == "assistant" for c in chat.choices)
    wait_clean(live)


@pytest.mark.parametrize(
    ("field", "value"),
    [("stream", True), ("top_p", 0.5), ("stop", ["x"]), ("logprobs", 2), ("n", 11)],
)
def test_what_it_cannot_apply_is_a_400_naming_the_field(
    served: tuple[Live, openai.OpenAI], field: str, value: Any
) -> None:
    live, _ = served
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, **SEARCH, field: value}
    with live.client() as http:
        answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field
    assert "use_beam_search" in answer.json()["error"]["message"]


def test_a_client_that_goes_away_cancels_the_search(served: tuple[Live, openai.OpenAI]) -> None:
    live, _ = served
    body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "n": 4, **SEARCH}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: live.stats()["live_requests"], what="the search's requests")
    stats = wait_clean(live)
    assert stats["running"] == 0
    # The search stopped: the whole of it is 4 beams x 400 steps of requests. (Whether
    # a step's requests are cancelled depends on where the disconnect falls: between
    # two steps none is live, and no step comes after it.)
    assert stats["finished"] < 400
