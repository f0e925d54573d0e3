"""vLLM's scoring routes for an embedding model: `POST /score` (`/v1/score`) and the
Jina- and Cohere-style `POST /rerank` (`/v1/rerank`, `/v2/rerank`).

A score is the cosine similarity of two texts' embeddings (`embeddings.embed_inputs`:
each text one `embed` request), as vLLM scores with an embedding model (a bi-encoder).
A cross-encoder reranker, which reads the pair together, is not served.

* `/score`: `text_1` and `text_2`, each a text or a list of texts. One `text_1` is
  scored against each `text_2`; two lists of one length, pair by pair.
* `/rerank`: a `query` and its `documents`, answered most relevant first, the first
  `top_n` of them (all unless given), each with its `index` among the documents and,
  unless `return_documents` is false, its text.

Leaving before the answer cancels every text's request, as on `/v1/embeddings`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint
from quart_schema import document_request

from kvscope.params import PRIORITY

from ..context import server
from ..errors import ApiError
from ..native.schemas import bounded_field
from .completions import read_openai_body
from .embeddings import embed_inputs
from .prompts import check_batch

blueprint = Blueprint("scores", __name__)


class _Scored(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="vLLM's: keep only each text's last k tokens"
    )
    priority: int = bounded_field(PRIORITY, 0)


class ScoreBody(_Scored):
    text_1: str | list[str] = Field(description="a text, or texts to pair with text_2's")
    text_2: str | list[str] = Field(description="a text, or texts")


class RerankBody(_Scored):
    query: str
    documents: list[str]
    top_n: int | None = Field(None, ge=0, description="the most relevant n (0 or unset: all)")
    return_documents: bool = True


@blueprint.post("/score")
@blueprint.post("/v1/score")
@document_request(ScoreBody)
async def score() -> Any:
    """The cosine similarity of each pair's embeddings."""
    body = await read_openai_body(ScoreBody)
    firsts, seconds = texts(body.text_1, "text_1"), texts(body.text_2, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise ApiError(
            400,
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
            "or as many as text_2",
            param="text_2",
        )
    fields = {text: "text_2" for text in seconds} | {text: "text_1" for text in firsts}
    unique = list(fields)  # each text embedded once
    embedded = await embed_inputs(
        server(),
        unique,
        truncate=body.truncate_prompt_tokens,
        priority=body.priority,
        model=body.model,
        param=[fields[text] for text in unique],
    )
    vectors = dict(zip(unique, embedded.vectors, strict=True))
    data = [
        {"index": i, "object": "score", "score": cosine(vectors[a], vectors[b])}
        for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
    ]
    answer = {
        "id": f"score-{embedded.first_id}",
        "object": "list",
        "created": int(time.time()),
        "model": embedded.model,
        "data": data,
        "usage": {"prompt_tokens": embedded.tokens, "total_tokens": embedded.tokens},
    }
    return answer, 200, {"X-Request-Id": embedded.first_id}


@blueprint.post("/rerank")
@blueprint.post("/v1/rerank")
@blueprint.post("/v2/rerank")
@document_request(RerankBody)
async def rerank() -> Any:
    """The documents, most relevant to the query first (the cosine similarity of
    their embeddings)."""
    body = await read_openai_body(RerankBody)
    documents = texts(body.documents, "documents")
    embedded = await embed_inputs(
        server(),
        [*texts(body.query, "query"), *documents],
        truncate=body.truncate_prompt_tokens,
        priority=body.priority,
        model=body.model,
        param=["query", *["documents"] * len(documents)],
    )
    query, *vectors = embedded.vectors
    results = []
    for index, (text, vector) in enumerate(zip(documents, vectors, strict=True)):
        result: dict[str, Any] = {"index": index, "relevance_score": cosine(query, vector)}
        if body.return_documents:
            result["document"] = {"text": text}
        results.append(result)
    results.sort(key=lambda r: r["relevance_score"], reverse=True)
    answer = {
        "id": f"rerank-{embedded.first_id}",
        "model": embedded.model,
        "usage": {"total_tokens": embedded.tokens},
        "results": results[: body.top_n or None],
    }
    return answer, 200, {"X-Request-Id": embedded.first_id}


def texts(value: str | list[str], field: str) -> list[str]:
    """A field's texts: one or more, none empty, at most `MAX_BATCH` (else a 400 naming
    the field)."""
    given = [value] if isinstance(value, str) else value
    if not given or not all(given):
        raise ApiError(400, f"{field} needs one text or more, none empty", param=field)
    check_batch(len(given), field)
    return given


def cosine(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Of two L2-normalized embeddings (their dot product, clamped)."""
    return max(-1.0, min(1.0, math.fsum(x * y for x, y in zip(a, b, strict=True))))
