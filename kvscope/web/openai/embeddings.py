"""OpenAI's `POST /v1/embeddings` (vLLM's too): each input's embedding.

An input is text, token ids, or a batch of either; or, as vLLM takes it, a chat
(`messages`, rendered by the chat template with vLLM's options, without opening the
assistant's turn unless `add_generation_prompt`). Each becomes one engine request
with `embed` (`SamplingParams.embed`): its prompt is computed as any prompt is (in
chunks, from the prefix cache, batched beside generations), and its answer is the
last token's final hidden state, L2-normalized, the pooling of decoder embedding
models (Qwen3-Embedding, e5-mistral, gte-Qwen2). It generates no token and frees its
blocks as it ends.

* `dimensions` keeps the first d values and normalizes them again (the Matryoshka
  way; a model trained for it keeps its quality there, as OpenAI's text-embedding-3
  models do);
* `encoding_format: base64` sends the float32 values' little-endian bytes, as OpenAI
  does (the `openai` package asks for it by default);
* vLLM's `truncate_prompt_tokens`, `add_special_tokens` and `priority`.

Leaving before the answer cancels every input's request (`disconnect`), and
`DELETE /requests/{id}` cancels one (the `X-Request-Id` header names the first
input's): the call then answers 409 naming it. An input longer than the context is a
400, as an unknown field is.
"""

from __future__ import annotations

import base64
import math
import sys
import time
from array import array
from collections.abc import Sequence
from typing import Any, Literal

import attrs
from pydantic import ConfigDict, Field
from quart import Blueprint
from quart_schema import document_request

from kvscope import InvalidRequest, Job
from kvscope.params import PRIORITY

from ..auth import current_owner
from ..context import ServerContext, disconnect_reason, server
from ..errors import ApiError, from_engine
from ..native.schemas import bounded_field
from .chat import chat_prompt
from .chat_schemas import ChatMessage, ChatTemplateOptions
from .completions import read_openai_body
from .model_names import adapter_of
from .prompts import Prompt, batch, check_batch, prompt_ids
from .run import cancel_all

blueprint = Blueprint("embeddings", __name__, url_prefix="/v1")


class EmbeddingBody(ChatTemplateOptions):
    model_config = ConfigDict(extra="forbid", strict=True)  # as OpenAISampling: no coercion
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = Field(
        None, description="text, token ids, or a batch of either (or messages)"
    )
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="vLLM's: a chat, rendered by the chat template"
    )
    add_generation_prompt: bool = Field(False, description="vLLM's: open the assistant's turn")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first d values, normalized")
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="vLLM's: keep only each input's last k tokens"
    )
    add_special_tokens: bool = Field(True, description="vLLM's: the tokenizer's BOS and such")
    priority: int = bounded_field(PRIORITY, 0)
    user: str | None = None  # no effect: accepted as OpenAI's


@blueprint.post("/embeddings")
@document_request(EmbeddingBody)
async def embeddings() -> Any:
    """Each input's embedding: the last token's final hidden state, normalized."""
    ctx = server()
    body = await read_openai_body(EmbeddingBody)
    hidden = ctx.engine.loaded.config.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise ApiError(
            400,
            f"dimensions is {body.dimensions}; this model's embeddings have {hidden}",
            param="dimensions",
        )
    if (body.input is None) == (body.messages is None):
        raise ApiError(400, "give input or messages (one of them)", param="input")
    if body.messages is not None:
        texts: list[Prompt] = [await chat_prompt(ctx.engine, body.messages, body)]
    else:
        assert body.input is not None
        texts = batch(body.input, param="input")
    embedded = await embed_inputs(
        ctx,
        texts,
        truncate=body.truncate_prompt_tokens,
        add_special_tokens=body.add_special_tokens,
        priority=body.priority,
        model=body.model,
        param="input" if body.messages is None else "messages",
    )
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": encoded(shortened(vector, body.dimensions), body),
        }
        for index, vector in enumerate(embedded.vectors)
    ]
    answer = {
        "id": f"embd-{embedded.first_id}",
        "object": "list",
        "created": int(time.time()),
        "model": embedded.model,
        "data": data,
        "usage": {"prompt_tokens": embedded.tokens, "total_tokens": embedded.tokens},
    }
    return answer, 200, {"X-Request-Id": embedded.first_id}


@attrs.frozen
class Embedded:
    """The embeddings of a call's texts, in order; their prompt tokens, the first
    text's request id, and the model (or LoRA adapter) that embedded them."""

    vectors: list[tuple[float, ...]]
    tokens: int
    first_id: str
    model: str


async def embed_inputs(
    ctx: ServerContext,
    texts: Sequence[Prompt],
    *,
    truncate: int | None = None,
    add_special_tokens: bool = True,
    priority: int = 0,
    model: str | None = None,
    param: str | Sequence[str],
) -> Embedded:
    """Each text's embedding, one `embed` request each (`param` names the field that
    holds them, or each one's, in a 400), with the LoRA adapter the body's `model`
    names, if it names one. Leaving before they are all done cancels them all; one
    that ends without its embedding (a DELETE) is a 409 naming it."""
    engine = ctx.engine
    lora = adapter_of(engine, model)
    fields = [param] * len(texts) if isinstance(param, str) else list(param)
    check_batch(len(texts), fields[-1])
    inputs = []
    for text, field in zip(texts, fields, strict=True):
        ids = await prompt_ids(engine, text, add_special_tokens=add_special_tokens, param=field)
        if truncate is not None:
            ids = ids[-truncate:]
        if len(ids) > engine.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {engine.max_model_len} tokens; "
                f"{field} holds a text of {len(ids)} tokens.",
                param=field,
            )
        inputs.append(ids)
    jobs: list[Job] = []
    try:
        for ids, field in zip(inputs, fields, strict=True):
            try:
                jobs.append(
                    await engine.submit(
                        ids,
                        embed=True,
                        max_tokens=1,
                        priority=priority,
                        owner=current_owner(),
                        lora=lora,
                    )
                )
            except InvalidRequest as exc:  # its prompt is the body's `field`
                raise from_engine(exc, names={"prompt": field, "lora": "model"}) from None
        results = [await job.wait() for job in jobs]
    finally:
        if not all(job.done for job in jobs):
            cancel_all(ctx, jobs, disconnect_reason())
    vectors = []
    for result in results:
        if result.embedding is None:
            failed = result.finish_reason == "error"
            raise ApiError(
                500 if failed else 409,
                f"request {result.id} ended without its embedding: {result.finish_reason}"
                + (f" ({result.cancel_reason})" if result.cancel_reason else "")
                + (f": {result.error}" if result.error else ""),
                "internal_error" if failed else "conflict_error",
            )
        vectors.append(result.embedding)
    return Embedded(vectors, sum(map(len, inputs)), jobs[0].id, lora or engine.model_name)


def shortened(vector: tuple[float, ...], dimensions: int | None) -> tuple[float, ...]:
    """The first `dimensions` values, L2-normalized again (all of them if None)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in head)) or 1.0
    return tuple(x / norm for x in head)


def encoded(vector: tuple[float, ...], body: EmbeddingBody) -> list[float] | str:
    if body.encoding_format == "float":
        return list(vector)
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()  # OpenAI's bytes are little-endian
    return base64.b64encode(values.tobytes()).decode("ascii")
