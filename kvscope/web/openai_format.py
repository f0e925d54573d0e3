"""How OpenAI's responses look: choices, log-probabilities, usage and stream chunks.

`Choices` shows a choice's text and log-probabilities in the completions or the chat
format. `ChunkFormat` builds a streamed response's chunk objects; the chunk sent for
each token (a text delta without log-probabilities) is the per-token path, so it is
pre-built as a JSON template around the one string that changes, and `text_chunk`
gives the same bytes as `sse.encode(chunk(index, text, None))` at a fraction of the
cost (tests/web/test_sse_body.py holds the two together).
"""

from __future__ import annotations

from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

from kvscope import Engine
from kvscope.kernels.sampling import TokenLogprobs

from .openai_schemas import OpenAISampling
from .sse import dumps, frame


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Choices:
    """How a choice's text and log-probabilities are shown, in OpenAI's formats."""

    def __init__(
        self, engine: Engine, body: OpenAISampling, *, chat: bool, echo: list[str] | None
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.n = body.n
        self.echo = echo
        self.wanted = body.logprobs_wanted is not None

    def prefix(self, index: int) -> str:
        """The echoed prompt of choice `index` (completions with `echo`)."""
        return self.echo[index // self.n] if self.echo is not None else ""

    def token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token], skip_special_tokens=False)

    def logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        index: int,
        offset: int = 0,
    ) -> dict[str, Any] | None:
        if not self.wanted or logprobs is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        **self._entry(t, lp.logprob),
                        "top_logprobs": [self._entry(*x) for x in lp.top],
                    }
                    for t, lp in zip(token_ids, logprobs, strict=True)
                ],
                "refusal": None,
            }
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        at = offset or len(self.prefix(index))
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [self._top(lp) for lp in logprobs],
            "text_offset": offsets,
        }

    def _top(self, logprobs: TokenLogprobs) -> dict[str, float]:
        """Completions' `{token text: logprob}`; two tokens that decode alike (parts of
        one character) would collide, so the later one is keyed `token_id:N` (vLLM's
        spelling of a token by id)."""
        top: dict[str, float] = {}
        for token, value in logprobs.top:
            text = self.token_text(token)
            top[text if text not in top else f"token_id:{token}"] = value
        return top

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class ChunkFormat:
    """The chunk objects of one streamed response (`chat.completion.chunk` or
    `text_completion`), told apart by their choice's `index`."""

    def __init__(self, request_id: str, created: int, model: str, *, chat: bool) -> None:
        self.chat = chat
        kind = "chat.completion.chunk" if chat else "text_completion"
        self.head: dict[str, Any] = {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
        }
        # `chunk(i, text, None)` as JSON is `open + i + middle + json(text) + close`.
        self._open = dumps(self.head)[:-1] + ',"choices":[{"index":'
        text_key = '"delta":{"content":' if chat else '"text":'
        self._middle = ',"finish_reason":null,"logprobs":null,' + text_key
        self._close = "}}]}" if chat else "}]}"

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        *,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**self.head, "choices": [choice]}

    def text_chunk(self, index: int, text: str) -> bytes:
        """The SSE message of `chunk(index, text, None)`, from the template."""
        return frame(
            f"{self._open}{index}{self._middle}{encode_basestring_ascii(text)}{self._close}"
        )

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
