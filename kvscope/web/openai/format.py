"""How OpenAI's responses look: choices, log-probabilities, usage and stream chunks.

`Choices` shows a choice's text and log-probabilities in the completions or the chat
format, with the echoed prompt's first (completions with `echo`, scored with
`logprobs`). `ChunkFormat` builds a streamed response's chunk objects; the chunk sent
for each token (a text delta without log-probabilities) is the per-token path, so it is
pre-built as a JSON template around the one string that changes, and `text_chunk` gives
the same bytes as `sse.encode(chunk(index, text, None))` at a fraction of the
cost (tests/web/test_sse_body.py holds the two together).

The shapes are vLLM's where OpenAI allows several (docs/openai.md, "vLLM conformance"): a
completions token's `top_logprobs` holds the token itself and the top k (one entry
for `logprobs: 0`); an echoed token-id prompt shows its special tokens; usage counts
the cached prompt tokens only under `--enable-prompt-tokens-details`.
"""

from __future__ import annotations

from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

from kvscope import Completion, Engine, Tokenizer, TokenLogprobs

from ..sse import dumps, frame
from .prompts import completion_prompts
from .schemas import CompletionBody, OpenAISampling

#: OpenAI keys that vLLM's whole answers (not its chunks) carry as null.
WHOLE_ANSWER_NULLS: dict[str, None] = {"service_tier": None, "system_fingerprint": None}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; with `cached_tokens` (known once the prompts' requests ended),
    `prompt_tokens_details` says how many of the prompt tokens the prefix cache held."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


def usage_of(results: Sequence[Completion], n: int, *, details: bool) -> dict[str, Any]:
    """The usage of a call's ended samples (`n` a prompt, in choice order): each prompt
    counted once (its sample 0's), every sample's completion; with `details` (vLLM's
    `--enable-prompt-tokens-details`), the prompt tokens the prefix cache held."""
    firsts = results[::n]
    cached = sum(r.cached_tokens for r in firsts) if details else None
    completion = sum(r.completion_tokens for r in results)
    return usage(sum(r.prompt_tokens for r in firsts), completion, cached)


class Choices:
    """How a choice's text and log-probabilities are shown, in OpenAI's formats."""

    def __init__(
        self,
        engine: Engine,
        body: OpenAISampling,
        prompts: list[list[int]],
        *,
        chat: bool,
        as_ids: bool = False,
    ) -> None:
        self.engine = engine
        self._texts: dict[int, str] = {}
        #: Log-probabilities show tokens as `token_id:N` (vLLM's
        #: `return_tokens_as_token_ids`; `as_ids` the server's default).
        asked = body.return_tokens_as_token_ids
        self.as_ids = as_ids if asked is None else asked
        self.chat = chat
        self.n = body.n
        self.prompts = prompts  # choice i is prompts[i // n]'s
        echo = getattr(body, "echo", False)
        #: Per prompt, whether it came as token ids: its echo and the echo's offsets
        #: show its special tokens' text, as vLLM's do.
        self.given_as_ids = [False] * len(prompts)
        #: What each prompt's answers begin with: the prompt (completions), or the last
        #: message when it is the assistant's own (chat, vLLM's `echo`).
        self.echo: list[str] | None = None
        if echo and isinstance(body, CompletionBody):
            self.echo = self._echoes(body, prompts)
        elif (echoes := getattr(body, "echoes", None)) is not None:
            self.echo = echoes
        #: vLLM's `return_token_ids`: the prompt's ids and each choice's.
        self.return_token_ids = bool(body.return_token_ids)
        self.top_k = body.logprobs_wanted
        #: vLLM's `logprob_token_ids`: a token's alternatives are those tokens, all shown.
        self.pinned = bool(body.logprob_token_ids)
        self.wanted = self.top_k is not None
        #: The echoed prompts' log-probabilities come before the completions'.
        self.scores_echo = echo and self.wanted and not chat

    def _echoes(self, body: CompletionBody, prompts: list[list[int]]) -> list[str]:
        """Each prompt as `echo` shows it (vLLM's): a text prompt as it was sent (or, cut
        by `truncate_prompt_tokens`, its tokens' text), token ids as their text, special
        tokens included."""
        echoes = []
        for index, (given, ids) in enumerate(zip(completion_prompts(body), prompts, strict=True)):
            self.given_as_ids[index] = not isinstance(given, str)
            if isinstance(given, str) and body.truncate_prompt_tokens is None:
                echoes.append(given)
            else:
                keep = self.given_as_ids[index]
                echoes.append(self.engine.tokenizer.decode(ids, skip_special_tokens=not keep))
        return echoes

    def returned_ids(self, index: int, token_ids: Sequence[int]) -> tuple[Any, Any]:
        """vLLM's `prompt_token_ids` and `token_ids` of choice `index` (null unless
        `return_token_ids`): its prompt's and `token_ids`, the tokens it made so far."""
        if not self.return_token_ids:
            return None, None
        return list(self.prompts[index // self.n]), list(token_ids)

    def prefix(self, index: int) -> str:
        """The echoed prompt of choice `index` (completions with `echo`)."""
        return self.echo[index // self.n] if self.echo is not None else ""

    def first_offset(self, index: int) -> int:
        """Where choice `index`'s first generated token's `text_offset` is: after its
        echo (after the echoed tokens as shown, where they show as `token_id:N`)."""
        if self.as_ids and self.scores_echo:
            return sum(len(self.shown(t)) for t in self.prompts[index // self.n])
        return len(self.prefix(index))

    def of_result(self, result: Completion, index: int) -> dict[str, Any] | None:
        """The log-probabilities of choice `index`'s whole answer: its echoed prompt's
        (if scored), then its tokens'."""
        generated = self.logprobs(result.token_ids, result.logprobs, index)
        prompt = self.prompt_logprobs(index, result.prompt_logprobs)
        if prompt is None or generated is None:
            return generated
        return {key: prompt[key] + generated[key] for key in prompt}

    def vllm_prompt_logprobs(
        self, index: int, logprobs: Sequence[TokenLogprobs | None] | None
    ) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs` of choice `index`: per prompt token, None for the
        first, else `{token id: {logprob, rank, decoded_token}}` for the token itself
        and the top k (rank 1 the most likely)."""
        if logprobs is None:
            return None
        ids = self.prompts[index // self.n]
        out: list[dict[str, Any] | None] = []
        for token, lp in zip(ids, logprobs, strict=True):
            if lp is None:
                out.append(None)
                continue
            entry = {
                str(t): {"logprob": v, "rank": rank, "decoded_token": self.token_text(t)}
                for rank, (t, v) in enumerate(lp.top, start=1)
            }
            entry.setdefault(
                str(token),
                {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.token_text(token)},
            )
            out.append(entry)
        return out

    def prompt_logprobs(
        self, index: int, logprobs: Sequence[TokenLogprobs | None] | None
    ) -> dict[str, Any] | None:
        """The completions-format log-probabilities of choice `index`'s echoed prompt
        (the first token's null: nothing predicts it). Offsets index the echoed text,
        where a special token (a BOS) of a text prompt shows no text."""
        if not self.scores_echo or logprobs is None:
            return None
        prompt = index // self.n
        ids = self.prompts[prompt]
        tokens = [self.shown(t) for t in ids]
        if self.given_as_ids[prompt] or self.as_ids:
            lengths = list(map(len, tokens))
        else:
            lengths = [len(self.engine.tokenizer.decode([t])) for t in ids]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob if lp is not None else None for lp in logprobs],
            "top_logprobs": [
                self._top(t, lp) if lp is not None else None
                for t, lp in zip(ids, logprobs, strict=True)
            ],
            "text_offset": _offsets(lengths, 0),
        }

    def token_text(self, token: int) -> str:
        """A token's text, decoded once a view (`-1` shows the vocabulary each token)."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.engine.tokenizer.decode(
                [token], skip_special_tokens=False
            )
        return text

    def shown(self, token: int) -> str:
        """A token as log-probabilities show it: its text, or `token_id:N`."""
        return f"token_id:{token}" if self.as_ids else self.token_text(token)

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
            content = token_entries(
                self.engine.tokenizer, token_ids, logprobs, as_ids=self.as_ids, pinned=self.pinned
            )
            return {"content": content, "refusal": None}
        tokens = [self.shown(t) for t in token_ids]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [self._top(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)],
            "text_offset": _offsets(list(map(len, tokens)), offset or self.first_offset(index)),
        }

    def _top(self, token: int, logprobs: TokenLogprobs) -> dict[str, float]:
        """Completions' `{token text: logprob}` of `token` itself and the k most likely
        others (OpenAI's and vLLM's: so `logprobs: 0` gives the token alone). Two tokens
        that decode alike (parts of one character) would collide, so the later one is
        keyed `token_id:N` (vLLM's spelling of a token by id)."""
        others = [(t, v) for t, v in logprobs.top if t != token]
        every = self.pinned or self.top_k == -1  # the tokens named, or the vocabulary
        others = others if every else others[: self.top_k or 0]
        top: dict[str, float] = {}
        for candidate, value in [(token, logprobs.logprob), *others]:
            text = self.shown(candidate)
            top[text if text not in top else f"token_id:{candidate}"] = value
        return top


def token_entries(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    *,
    as_ids: bool = False,
    pinned: bool = False,
) -> list[dict[str, Any]]:
    """Chat's (and the Responses API's) log-probabilities of tokens: each one's text
    (`token_id:N` with `as_ids`), log-probability and its text's UTF-8 bytes, and the
    same of its top alternatives; of `logprob_token_ids` (`pinned`), the token itself
    and the tokens named (vLLM's)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token], skip_special_tokens=False)
        shown = f"token_id:{token}" if as_ids else text
        return {"token": shown, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def alternatives(token: int, lp: TokenLogprobs) -> list[tuple[int, float]]:
        if not pinned:
            return list(lp.top)
        return [(token, lp.logprob), *((t, v) for t, v in lp.top if t != token)]

    return [
        {**entry(token, lp.logprob), "top_logprobs": [entry(*x) for x in alternatives(token, lp)]}
        for token, lp in zip(token_ids, logprobs, strict=True)
    ]


def _offsets(lengths: list[int], start: int) -> list[int]:
    """Where each token's text starts, given their lengths, the first at `start`."""
    offsets = []
    for length in lengths:
        offsets.append(start)
        start += length
    return offsets


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
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str | None = None,
        ids: tuple[Any, Any] | None = None,
    ) -> dict[str, Any]:
        """A chunk of choice `index`; `ids` its `return_token_ids` pair (`returned_ids`):
        the prompt's, on a choice's first chunk only (chat's on the chunk itself), and
        the tokens it brings."""
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
        head = self.head
        if ids is not None:
            prompt, choice["token_ids"] = ids
            if self.chat and prompt is not None:
                head = {**head, "prompt_token_ids": prompt}
            elif not self.chat:
                choice["prompt_token_ids"] = prompt
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if text is not None or tool_calls:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**head, "choices": [choice]}

    def text_chunk(self, index: int, text: str) -> bytes:
        """The SSE message of `chunk(index, text, None)`, from the template."""
        return frame(
            f"{self._open}{index}{self._middle}{encode_basestring_ascii(text)}{self._close}"
        )

    def usage_chunk(self, counts: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": counts}
