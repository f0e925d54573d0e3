"""Streaming an OpenAI call: its samples' deltas as chunks, in vLLM's shape.

`stream_chunks` is the SSE body's generator: the opening chunks (chat's role, an echo),
each choice's chunks as its deltas arrive (interleaved, told apart by `index`), then
the usage chunk if asked and `[DONE]`; the stream's last chunk, the usage and `[DONE]`
go out in one write where its requests have all ended by then (a last token is never
held back waiting for them). `ChoiceStream` turns one choice's events into chunks: its text
(with a reasoning parser, `reasoning_content` and the answer; with tools, the content
up to a call and the calls, `tools.py`), its log-probabilities, and, under vLLM's
`continuous_usage_stats` (only with `include_usage`, as vLLM), its usage so far.

As vLLM's, a choice's `finish_reason` rides on the chunk of its last event: its last
token's, with an empty text when that token brought none (an EOS, a stop string cut
away). A delta is known to be the last when it reaches `max_tokens`, or when its
request has already ended as it is read (`Job.done`: the result counts what came).
A request whose last delta is read before its end was recorded (a reader and the
request's own task racing, rare) gets its `finish_reason` on an empty-text chunk when
its end arrives: the chunk vLLM sends for a last event that brings no text.

The per-token work of a plain text delta is one template fill (`ChunkFormat.text_chunk`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from kvscope import Completion, Delta, Job, TokenLogprobs, merge_streams

from ..parsers.reasoning import ReasoningParser, ReasoningStream
from ..parsers.tool_calls import CallStream
from ..sse import DONE, encode
from .format import Choices, ChunkFormat, usage, usage_of
from .schemas import OpenAISampling
from .tools import ToolPlan

#: A chunk object, or an SSE message already encoded (the per-token template's).
Piece = dict[str, Any] | bytes


class StreamSetup:
    """What every choice of one stream shares: the call, how its chunks look, its tools
    and reasoning parser, and whether usage counts the cached prompt tokens."""

    def __init__(
        self,
        body: OpenAISampling,
        view: Choices,
        fmt: ChunkFormat,
        tools: ToolPlan | None,
        reasoning: ReasoningParser,
        *,
        details: bool,
        force_usage: bool = False,
    ) -> None:
        self.body, self.view, self.fmt, self.reasoning = body, view, fmt, reasoning
        self.details = details
        #: The usage chunk, and usage on every chunk: as asked, or always under vLLM's
        #: `--enable-force-include-usage` (`force_usage`).
        self.include_usage = body.include_usage or force_usage
        self.continuous_usage = body.continuous_usage or force_usage
        #: The tool plan when the answer may call tools (its text is read for calls).
        self.whole = tools if tools is not None and tools.calls_tools else None
        self.auto = self.whole is not None and self.whole.mode == "auto"


class ChoiceStream:
    """One choice's chunks, from its deltas and its end. It has `finished` once its
    `finish_reason` went out."""

    def __init__(self, setup: StreamSetup, index: int, job: Job, prompt_tokens: int) -> None:
        self.setup, self.index, self.job = setup, index, job
        # As admitted: capped to the context where the call left max_tokens unset.
        self.prompt_tokens, self.max_tokens = prompt_tokens, job.params.max_tokens
        self.tokens = 0  # tokens read so far
        self.chars = 0  # characters of text read so far
        self.offset = setup.view.first_offset(index)  # where the next token's text starts
        #: An echo scored with `logprobs` waits for the prompt's log-probabilities,
        #: which come with the first token (or the end).
        self.echo_pending = setup.view.scores_echo
        self.finished = False
        self._ended: Completion | None = None
        #: Under `return_token_ids`: whether the prompt's ids went out, and the ids of
        #: the delta being read not yet on a chunk (the next chunk made carries them).
        self._prompt_sent = False
        self._ids: tuple[int, ...] = ()
        whole = setup.whole
        self.thinking = ReasoningStream(setup.reasoning) if setup.reasoning.splits else None
        held = whole.held_content() if whole is not None and setup.auto else None
        self.held = held
        single = whole is not None and whole.single
        self.calls = CallStream(held, single=single) if held is not None else None
        #: The text so far, where its end reads it whole (for tools and reasoning).
        self.said: list[str] | None = [] if whole or self.thinking else None

    # -- the events ------------------------------------------------------------------

    def opening(self) -> bytes:
        """What goes out before any token: chat's role, a completion's echo unless it
        waits for its scores."""
        view, chat = self.setup.view, self.setup.view.chat
        prefix = view.prefix(self.index)
        if (chat or prefix) and not self.echo_pending:
            return self._framed(self._chunk(prefix, role=chat))
        return b""

    def on_delta(self, delta: Delta) -> bytes:
        """The chunks of a delta; with the `finish_reason` if it is the last."""
        pieces: list[Piece] = []
        if self.echo_pending and delta.token_ids:
            pieces.append(self._echo(delta.prompt_logprobs))
        self._ids = delta.token_ids
        first = not self.tokens
        self.tokens += len(delta.token_ids)
        self.chars += len(delta.text)
        if self.said is not None:
            self.said.append(delta.text)
        reason = self._last_reason()
        text = delta.text
        if self.thinking is not None:
            thought, text = self.thinking.feed(text)
            if thought:
                pieces.append(self._chunk(None, reasoning=thought))
        if self.setup.whole is not None:
            pieces += self._tool_pieces(text, first)
        elif self.setup.view.wanted and (text or delta.logprobs):
            pieces.append(self._logprobs_chunk(text, delta.token_ids, delta.logprobs))
        elif text:
            pieces.append(self._text_piece(text, plain=reason is None))
        if self._ids and self.setup.view.return_token_ids:  # every token goes out on a chunk
            pieces.append(self._chunk(None if self.setup.view.chat else ""))
        if reason is not None:
            return self._finish(pieces, reason)
        return self._joined(pieces)

    def on_end(self) -> bytes:
        """The chunks of the request's end: what was held back, and the
        `finish_reason` unless the last delta carried it."""
        result = self._result()
        assert result is not None  # the stream ends once the request has
        pieces: list[Piece] = []
        if self.echo_pending:
            pieces.append(self._echo(result.prompt_logprobs))
        if self.finished:
            return self._joined(pieces)
        return self._finish(pieces, result.finish_reason)

    # -- stages ----------------------------------------------------------------------

    def _last_reason(self) -> str | None:
        """The finish reason if the delta just read is the choice's last, else None."""
        result = self._result()
        if result is not None:
            read_all = self.tokens == result.completion_tokens and self.chars == len(result.text)
            return result.finish_reason if read_all else None
        return "length" if self.tokens >= self.max_tokens else None

    def _result(self) -> Completion | None:
        """The request's result once it has ended (built once)."""
        if self._ended is None and self.job.done:
            self._ended = self.job.result
        return self._ended

    def _tool_pieces(self, text: str, first: bool) -> list[Piece]:
        """Under tools: a named function's arguments as they come; under `auto` the
        content up to where a call may begin, then each call's name and arguments."""
        whole = self.setup.whole
        assert whole is not None
        if whole.streams_arguments:
            if text or first:
                return [self._chunk(None, tool_calls=whole.argument_deltas(text, first))]
            return []
        pieces: list[Piece] = []
        if self.held is not None and self.calls is not None:
            if piece := self.held.feed(text):
                pieces.append(self._chunk(piece))
            if calls := self.calls.advance():
                pieces.append(self._chunk(None, tool_calls=calls))
        return pieces

    def _end_pieces(self, reason: str) -> tuple[list[Piece], str]:
        """What the end releases: the reasoning and answer held back, the calls not sent
        yet (a call it could not stream, or all of them under `required`); and the
        finish reason (`tool_calls` where tools were called)."""
        setup, whole = self.setup, self.setup.whole
        answer = "".join(self.said or ())
        pieces: list[Piece] = []
        if self.thinking is not None:
            thought, rest = self.thinking.finish()
            if thought:
                pieces.append(self._chunk(None, reasoning=thought))
            if rest and whole is None:
                pieces.append(self._chunk(rest))
            answer = setup.reasoning.split(answer)[1] or ""
        if whole is not None and whole.streams_arguments:
            if not self.tokens:  # no token came: the call is named all the same
                pieces.append(self._chunk(None, tool_calls=whole.argument_deltas("", first=True)))
        elif whole is not None:
            content, calls, reason = whole.answer(answer, reason)
            if self.held is not None and self.calls is not None:  # `auto`: what is not sent
                content = None if self.calls.opened else self.held.rest(answer) or None
                calls = self.calls.rest(calls)
            if content or calls:
                pieces.append(self._chunk(content, tool_calls=calls))
        return pieces, reason

    def _finish(self, pieces: list[Piece], reason: str) -> bytes:
        """`pieces` and the end's, the last carrying `finish_reason` (an empty text
        where there is none, as vLLM's last chunk of an event without text)."""
        self.finished = True
        more, reason = self._end_pieces(reason)
        pieces += more
        if not pieces or not isinstance(pieces[-1], dict):
            view = self.setup.view
            plain = self.setup.whole is None and self.thinking is None
            scores = view.logprobs((), (), self.index, self.offset)  # empty, where asked
            pieces.append(self._chunk("" if plain or not view.chat else None, logprobs=scores))
        last = pieces[-1]
        assert isinstance(last, dict)
        last["choices"][0]["finish_reason"] = reason
        return self._joined(pieces)

    # -- chunks ----------------------------------------------------------------------

    def _chunk(self, text: str | None, **extra: Any) -> dict[str, Any]:
        view = self.setup.view
        if view.return_token_ids:
            prompt, ids = view.returned_ids(self.index, self._ids)
            extra["ids"] = (None if self._prompt_sent else prompt, ids)
            self._prompt_sent, self._ids = True, ()
        return self.setup.fmt.chunk(self.index, text, None, **extra)

    def _text_piece(self, text: str, *, plain: bool) -> Piece:
        """A text delta: the per-token template unless the chunk carries more."""
        body = self.setup.body
        if plain and not self.setup.continuous_usage and not body.return_token_ids:
            return self.setup.fmt.text_chunk(self.index, text)
        return self._chunk(text)

    def _logprobs_chunk(
        self, text: str, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
    ) -> dict[str, Any]:
        view = self.setup.view
        scores = view.logprobs(token_ids, logprobs, self.index, self.offset)
        self.offset += sum(len(view.shown(t)) for t in token_ids)
        return self._chunk(text, logprobs=scores)

    def _echo(self, scored: Sequence[TokenLogprobs | None] | None) -> dict[str, Any]:
        self.echo_pending = False
        view = self.setup.view
        logprobs = view.prompt_logprobs(self.index, scored)
        return self._chunk(view.prefix(self.index), logprobs=logprobs)

    def _framed(self, chunk: dict[str, Any]) -> bytes:
        """A chunk as its SSE message, with the choice's usage so far where asked."""
        if self.setup.continuous_usage:
            chunk["usage"] = usage(self.prompt_tokens, self.tokens)
        return encode(chunk)

    def _joined(self, pieces: list[Piece]) -> bytes:
        return b"".join(p if isinstance(p, bytes) else self._framed(p) for p in pieces)


async def stream_chunks(jobs: list[Job], setup: StreamSetup) -> AsyncGenerator[bytes, None]:
    """The SSE chunks of the samples as they arrive, the usage chunk if asked, `[DONE]`."""
    n, prompts = setup.body.n, setup.view.prompts
    choices = [ChoiceStream(setup, i, job, len(prompts[i // n])) for i, job in enumerate(jobs)]
    if opening := b"".join(choice.opening() for choice in choices):
        yield opening
    unfinished, last = len(choices), b""
    async for index, delta in merge_streams(jobs):
        choice = choices[index]
        was_finished = choice.finished
        out = choice.on_delta(delta) if delta is not None else choice.on_end()
        if choice.finished and not was_finished:
            unfinished -= 1
            # The stream's last chunk goes out with the usage and [DONE] where every
            # request has ended (their ends are then read at once), else at once.
            if not unfinished and all(job.done for job in jobs):
                last = out
                continue
        if out:
            yield out
    if setup.include_usage:
        counts = usage_of([job.result for job in jobs], n, details=setup.details)
        last += encode(setup.fmt.usage_chunk(counts))
    yield last + DONE
