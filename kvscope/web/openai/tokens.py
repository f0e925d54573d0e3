"""vLLM's token routes: `POST /tokenize`, `POST /detokenize` and `GET /version`.

`/tokenize` takes a completions prompt (`prompt`, text) or a chat (`messages`, rendered
with the model's template exactly as `/v1/chat/completions` renders it) and answers its
token ids, their count and the model's context length, as vLLM does; `/detokenize`
answers the text of token ids. They keep the generation routes' rules: the prompt's
size limit (and tokenizing off the loop when big), ids inside the vocabulary, a model
this server runs, every field known; anything else is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from quart import Blueprint
from quart_schema import document_request

import kvscope

from ..bodies import read_body
from ..context import server
from ..errors import ApiError
from ..native.schemas import Strict
from .chat import chat_prompt
from .chat_schemas import ChatMessage, ChatTemplateOptions
from .model_names import check_model
from .tools import ToolDef, ToolPlan

blueprint = Blueprint("tokens", __name__)

#: `/tokenize` fields for a chat only, and for a text prompt only.
CHAT_ONLY = frozenset(
    {"tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
)
PROMPT_ONLY = frozenset({"add_special_tokens"})


class TokenizeBody(ChatTemplateOptions, Strict):
    """One of `prompt` (text) or `messages` (a chat, and how to render it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = Field(True, description="with `prompt`: the BOS the model adds")
    return_token_strs: bool = Field(False, description="each token's text as well")
    tools: list[ToolDef] | None = Field(None, description="with `messages`: for the template")


class DetokenizeBody(Strict):
    model: str | None = None
    tokens: list[int]


@blueprint.post("/tokenize")
@document_request(TokenizeBody)
async def tokenize() -> Any:
    """A prompt's or a chat's token ids, as the generation routes would compute them."""
    body = await read_body(TokenizeBody)
    engine = server().engine
    check_model(engine, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give one of prompt or messages", param="prompt")
    unused = sorted(body.model_fields_set & (PROMPT_ONLY if body.messages else CHAT_ONLY))
    if unused:  # refused, never ignored
        what = "messages" if body.messages else "prompt"
        raise ApiError(400, f"{unused[0]} does not apply with {what}", param=unused[0])
    if body.messages is not None:
        tools = ToolPlan.of(body.tools, None, None).template_tools()
        ids = await chat_prompt(engine, body.messages, body, tools=tools)
    else:
        assert body.prompt is not None
        ids = await engine.encode_text(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = None
    if body.return_token_strs:
        strs = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


@blueprint.post("/detokenize")
@document_request(DetokenizeBody)
async def detokenize() -> Any:
    """The text of token ids (special tokens left out, as in a completion's text)."""
    body = await read_body(DetokenizeBody)
    engine = server().engine
    check_model(engine, body.model)
    vocab = engine.loaded.config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise ApiError(400, f"tokens must be integers in [0, {vocab})", param="tokens")
    size = len(body.tokens) * 4  # a token decodes to a few bytes: the size of the work
    text = await engine.run_off_loop(size, lambda: engine.tokenizer.decode(body.tokens))
    return {"prompt": text}


@blueprint.get("/version")
async def version() -> Any:
    return {"version": kvscope.__version__}
