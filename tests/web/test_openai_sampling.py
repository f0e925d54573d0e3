"""Log-probabilities, penalties and logit bias against hand computations: a tiny
random Llama checkpoint is served by `kvscope serve`'s app and also run by
`transformers`; the server's answers (through the `openai` client and the native API)
must match what its logits give by hand, the prompt's scores (`echo` with `logprobs`)
too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.models.conftest import build_checkpoint

from .conftest import Live, running_server, sse_events, wait_status

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [0, 45, 67, 89, 45, 67, 89, 45, 67]  # BOS and a repeated pattern


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("sampling") / "llama")


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    return transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture
def served(backend: str, tmp_path: Path, checkpoint: Path) -> Iterator[tuple[Live, openai.OpenAI]]:
    with (
        running_server(backend, tmp_path, model=str(checkpoint)) as live,
        openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0, timeout=30) as client,
    ):
        yield live, client


def next_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0, -1].float()


def token_ids(live: Live, request_id: str) -> list[int]:
    with live.client() as http:
        return http.get(f"/requests/{request_id}").json()["token_ids"]


def test_logprobs_are_the_log_softmax_of_the_models_logits(
    served: tuple[Live, openai.OpenAI], hf_model: Any, checkpoint: Path
) -> None:
    live, client = served
    model = checkpoint.name
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    generated = token_ids(live, out.id)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(generated) == 6
    for i, token in enumerate(generated):
        by_hand = torch.log_softmax(next_logits(hf_model, PROMPT + generated[:i]), dim=-1)
        assert logprobs.token_logprobs[i] == pytest.approx(float(by_hand[token]), abs=1e-4)
        assert token == int(by_hand.argmax())
        top = by_hand.topk(3)
        assert sorted(logprobs.top_logprobs[i].values(), reverse=True) == pytest.approx(
            top.values.tolist(), abs=1e-4
        )
    # Streaming gives the same numbers, chunk by chunk.
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        lp for c in stream for ch in c.choices if ch.logprobs for lp in ch.logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=1e-5)
    # Chat: the chosen token's logprob and its top alternatives, with their bytes.
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)
    assert content[0].bytes == list(content[0].token.encode())
    # The native API's SSE stream carries them in its token events.
    with live.client() as http:
        body = {
            "prompt_token_ids": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "stream": True,
        }
        with http.stream("POST", "/generate", json=body) as response:
            events = [e for e in sse_events(response.iter_lines()) if e["type"] == "token"]
    native = [lp["logprob"] for e in events for lp in e.get("logprobs", ())]
    assert native == pytest.approx(logprobs.token_logprobs, abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt_by_hand(
    served: tuple[Live, openai.OpenAI], hf_model: Any, checkpoint: Path
) -> None:
    """lm-evaluation-harness's log-likelihood call (`echo`, `logprobs`, one new token):
    the prompt's tokens come first, the first with no log-probability, each other one
    the log-softmax of the logits before it; streamed, the echo chunk carries them;
    vLLM's `prompt_logprobs` shows the same numbers, and the native API's first token
    event carries them."""
    live, client = served
    by_hand = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    expected = [float(by_hand[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    call = {"model": checkpoint.name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    out = client.completions.create(**call, echo=True, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(PROMPT) + 1 == len(logprobs.text_offset)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1 : len(PROMPT)] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(PROMPT)):  # the token itself and the 2 most likely others
        ranked = by_hand[i - 1].topk(3)
        pairs = zip(ranked.indices.tolist(), ranked.values.tolist(), strict=True)
        others = [value for token, value in pairs if token != PROMPT[i]][:2]
        top = sorted([expected[i - 1], *others], reverse=True)
        assert sorted(logprobs.top_logprobs[i].values(), reverse=True) == pytest.approx(
            top, abs=1e-4
        )
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    generated = token_ids(live, out.id)[0]
    assert logprobs.token_logprobs[-1] == pytest.approx(float(by_hand[-1, generated]), abs=1e-4)
    stream = client.completions.create(**call, echo=True, logprobs=2, stream=True)
    chunks = [ch for c in stream for ch in c.choices if ch.logprobs]
    assert chunks[0].text == out.choices[0].text[: len(chunks[0].text)] and chunks[0].text
    streamed = [lp for ch in chunks for lp in ch.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(logprobs.token_logprobs[1:])
    # vLLM's `prompt_logprobs`: per choice on completions, once on chat; never streamed.
    vllm = client.completions.create(**call, extra_body={"prompt_logprobs": 1}).model_dump()
    scores = vllm["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        assert scores[i][str(PROMPT[i])]["logprob"] == pytest.approx(expected[i - 1], abs=1e-4)
        best = int(by_hand[i - 1].argmax())
        assert scores[i][str(best)]["rank"] == 1
        above = int((by_hand[i - 1] > by_hand[i - 1, PROMPT[i]]).sum())
        assert scores[i][str(PROMPT[i])]["rank"] == above + 1
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=call["model"], messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    ).model_dump()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**call, stream=True, extra_body={"prompt_logprobs": 0})
    assert refused.value.body["param"] == "prompt_logprobs"
    with live.client() as http:
        body = {"prompt_token_ids": PROMPT, "max_tokens": 2, "prompt_logprobs": 0, "stream": True}
        with http.stream("POST", "/generate", json=body) as response:
            events = [e for e in sse_events(response.iter_lines()) if e["type"] == "token"]
    native = events[0]["prompt_logprobs"]
    assert native[0] is None and [e["logprob"] for e in native[1:]] == pytest.approx(
        expected, abs=1e-4
    )
    assert all("prompt_logprobs" not in e for e in events[1:])


def by_hand_greedy(hf_model: Any, steps: int, **fields: Any) -> list[int]:
    """Greedy decoding with vLLM's processors written out token by token."""
    bias = {int(k): v for k, v in fields.get("logit_bias", {}).items()}
    rep = fields.get("repetition_penalty", 1.0)
    freq = fields.get("frequency_penalty", 0.0)
    pres = fields.get("presence_penalty", 0.0)
    out: list[int] = []
    for _ in range(steps):
        logits = next_logits(hf_model, PROMPT + out).tolist()
        for token, value in bias.items():
            logits[token] += value
        for token in set(PROMPT + out):
            logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
        for token in set(out):
            logits[token] -= freq * out.count(token) + pres
        out.append(max(range(len(logits)), key=logits.__getitem__))
    return out


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": -1.5},
        {"frequency_penalty": -1.0, "presence_penalty": 0.5},
        {"repetition_penalty": 1.8},
        {"logit_bias": {"45": 5.0, "67": -100}},
    ],
    ids=["presence", "frequency", "repetition", "bias"],
)
def test_penalties_and_bias_change_the_greedy_path_as_by_hand(
    served: tuple[Live, openai.OpenAI], hf_model: Any, checkpoint: Path, fields: dict
) -> None:
    live, client = served
    plain = by_hand_greedy(hf_model, 10)
    expected = by_hand_greedy(hf_model, 10, **fields)
    assert expected != plain  # the case is one where the field matters
    standard = {k: v for k, v in fields.items() if k != "repetition_penalty"}
    extra = {"ignore_eos": True, **{k: v for k, v in fields.items() if k == "repetition_penalty"}}
    out = client.completions.create(
        model=checkpoint.name,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body=extra,
        **standard,
    )
    assert token_ids(live, out.id) == expected
    with live.client() as http:
        body = {
            "prompt_token_ids": PROMPT,
            "max_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
            **fields,
        }
        job = http.post("/generate", json=body).json()["id"]
        assert wait_status(http, job)["token_ids"] == expected
