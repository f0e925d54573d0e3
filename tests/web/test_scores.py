"""vLLM's `/score` and `/rerank` on the real server: a score is the cosine similarity
of the two texts' embeddings (those `/v1/embeddings` answers), pairs are formed as vLLM
forms them, a rerank puts the documents most relevant first; bad bodies are 400s
naming the field, and no block is left."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvscope.web.openai.prompts import MAX_BATCH

from .conftest import Live, wait_clean

TEXTS = ["a cache of keys and values", "the quick brown fox", "a cache of keys"]


def embeddings(live: Live, texts: list[str]) -> list[list[float]]:
    with live.client() as http:
        answer = http.post("/v1/embeddings", json={"input": texts}).json()
    return [item["embedding"] for item in answer["data"]]


def cosine(a: list[float], b: list[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def test_a_score_is_the_cosine_of_two_embeddings(live: Live) -> None:
    vectors = embeddings(live, TEXTS)
    with live.client() as http:
        for path in ("/score", "/v1/score"):
            one_to_many = http.post(path, json={"text_1": TEXTS[0], "text_2": TEXTS[1:]})
            assert one_to_many.status_code == 200, one_to_many.text
            body = one_to_many.json()
            assert body["object"] == "list" and body["model"] == "tiny-random"
            assert [d["index"] for d in body["data"]] == [0, 1]
            assert all(d["object"] == "score" for d in body["data"])
            scores = [d["score"] for d in body["data"]]
            expected = [cosine(vectors[0], vectors[1]), cosine(vectors[0], vectors[2])]
            assert scores == pytest.approx(expected, abs=1e-4)
        pairs = http.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
        expected = [cosine(vectors[0], vectors[1]), cosine(vectors[1], vectors[2])]
        assert [d["score"] for d in pairs["data"]] == pytest.approx(expected, abs=1e-4)
        same = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[0]}).json()
        assert same["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
        tokens = len(http.post("/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"])
        assert same["usage"]["prompt_tokens"] == tokens  # the text embedded once
    wait_clean(live)


def test_a_rerank_puts_the_most_relevant_first(live: Live) -> None:
    query, *documents = TEXTS
    vectors = embeddings(live, TEXTS)
    expected = sorted(
        ((cosine(vectors[0], vectors[1 + i]), i) for i in range(len(documents))), reverse=True
    )
    with live.client() as http:
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            answer = http.post(path, json={"query": query, "documents": [*documents, query]})
            assert answer.status_code == 200, answer.text
            results = answer.json()["results"]
            # The query itself is the most relevant document: the same embedding.
            assert results[0]["index"] == 2 and results[0]["relevance_score"] == pytest.approx(1)
            assert results[0]["document"] == {"text": query}
            rest = [(r["relevance_score"], r["index"]) for r in results[1:]]
            assert [i for _, i in rest] == [i for _, i in expected]
            assert [s for s, _ in rest] == pytest.approx([s for s, _ in expected], abs=1e-4)
        top = http.post(
            "/rerank",
            json={"query": query, "documents": documents, "top_n": 1, "return_documents": False},
        ).json()["results"]
        assert [r["index"] for r in top] == [expected[0][1]] and "document" not in top[0]
    wait_clean(live)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/score", {"text_1": [], "text_2": ["c"]}, "text_1"),
        ("/score", {"text_1": "", "text_2": "c"}, "text_1"),
        ("/score", {"text_1": "a"}, "text_2"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "extra": 1}, "extra"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(
    live: Live, path: str, body: dict[str, Any], param: str
) -> None:
    with live.client() as http:
        answer = http.post(path, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    wait_clean(live)


def test_a_call_holds_at_most_max_batch_texts(live: Live) -> None:
    """Each text is tokenized before any runs: the count bounds a call's time on the
    event loop (a 1 MiB body holds ~250,000 one-letter prompts)."""
    many = ["a"] * (MAX_BATCH + 1)
    with live.client() as http:
        for path, body, param in (
            ("/v1/completions", {"prompt": many, "max_tokens": 1}, "prompt"),
            ("/v1/embeddings", {"input": many}, "input"),
            ("/rerank", {"query": "q", "documents": many}, "documents"),
            ("/score", {"text_1": "q", "text_2": many}, "text_2"),
        ):
            answer = http.post(path, json=body)
            assert answer.status_code == 400, (path, answer.text)
            assert answer.json()["error"]["param"] == param
            assert str(MAX_BATCH) in answer.json()["error"]["message"]
        assert live.stats()["finished"] == 0  # refused before any ran
        fits = http.post("/v1/embeddings", json={"input": many[:MAX_BATCH]})
        assert fits.status_code == 200 and len(fits.json()["data"]) == MAX_BATCH
    wait_clean(live)
