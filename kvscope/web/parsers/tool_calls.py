"""Reading tool calls out of what a model wrote, in the format it was trained on
(vLLM's `--tool-call-parser`).

* `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere
  in the text (Qwen2.5, Qwen3, Hermes); the text before the first is the content.
* `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (Mistral 7B
  v0.3, Mixtral, Nemo), or `[TOOL_CALLS]name[ARGS]{...}` once per call (newer
  tokenizers). Both markers are special tokens, so the request keeps special tokens in
  its text (`keeps_special_tokens`), as vLLM does.
* `llama3_json`: the whole message is one JSON call `{"name", "parameters"}` (or
  several separated by `;`), after an optional `<|python_tag|>` (Llama 3.1-3.3).

`auto` (the default) picks by the chat template: the one that shows `[TOOL_CALLS]` is
Mistral's, the one that shows `<|python_tag|>` or `ipython` Llama 3's; otherwise
Hermes. Each parser also tells a stream which text may still become a call
(`held_from`), so `HeldContent` sends the content as it comes and holds back the rest,
and `CallStream` sends the calls in it as they come: each one's name once whole, then
its arguments piece by piece. Text that does not parse as calls is the content, whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import attrs

#: The parsers `--tool-call-parser` names (`auto` picks one of the others).
PARSERS = ("auto", "hermes", "mistral", "llama3_json")

Calls = list[dict[str, Any]]


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """A call as OpenAI shows it; its arguments as JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _named(value: Any, arguments_key: str = "arguments") -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return tool_call(value["name"], value.get(arguments_key, value.get("arguments", {})))


def tag_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@attrs.frozen
class ToolParser:
    """One format: where its calls start in a text, and what they are."""

    name: str
    #: What opens a call (a tag a stream holds back once it comes).
    tag: str
    #: Where the calls begin in a text (its end if none) and the calls; text that does
    #: not parse as calls holds none.
    read: Callable[[str], tuple[int, Calls]] = attrs.field(repr=False)
    #: The format's markers are special tokens: the request keeps them in its text.
    keeps_special_tokens: bool = False
    #: A call is the whole message, or none is (Llama 3's): only its start may open one.
    whole_message: bool = False

    def calls(self, text: str) -> tuple[int, Calls]:
        return self.read(text)

    def held_from(self, text: str, sent: int) -> int:
        """Of `text`, of which `sent` characters went out as content: where what may
        still become a call begins (the end of `text` if nothing may)."""
        if self.whole_message:
            head = text.lstrip()
            may = not head or head.startswith("{") or head.startswith(self.tag)
            return 0 if sent == 0 and (may or self.tag.startswith(head)) else len(text)
        at = text.find(self.tag, sent)
        return at if at >= 0 else len(text) - tag_tail(text, self.tag)

    def opens_call(self, rest: str) -> bool:
        """Whether `rest` (the text from `held_from` on) has begun a call, not only a
        part of its tag."""
        if self.whole_message:
            return bool(rest.strip()) and not self.tag.startswith(rest.strip())
        return rest.startswith(self.tag)


#: What opens Mistral's calls, and Llama 3's python tag (before a JSON call).
MISTRAL_TAG, PYTHON_TAG = "[TOOL_CALLS]", "<|python_tag|>"
#: vLLM's `hermes` format: one call per block, JSON inside.
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _hermes(text: str) -> tuple[int, Calls]:
    calls, first = [], None
    for match in CALL_BLOCK.finditer(text):
        try:
            call = _named(json.loads(match.group(1)))
        except ValueError:
            continue
        if call is not None:
            calls.append(call)
            first = match.start() if first is None else first
    return (len(text) if first is None else first), calls


#: The newer Mistral format: `name[ARGS]{...}` after each `[TOOL_CALLS]`.
MISTRAL_CALL = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\](.*)", re.DOTALL)


def _mistral(text: str) -> tuple[int, Calls]:
    at = text.find(MISTRAL_TAG)
    if at < 0:
        return len(text), []
    pieces = [p for p in text[at:].split(MISTRAL_TAG) if p.strip()]
    calls: Calls = []
    try:
        if len(pieces) == 1 and pieces[0].lstrip().startswith("["):
            listed = json.loads(pieces[0])
            calls = [c for c in map(_named, listed if isinstance(listed, list) else []) if c]
        else:
            for piece in pieces:
                match = MISTRAL_CALL.fullmatch(piece)
                if match is None:
                    return len(text), []
                calls.append(tool_call(match.group(1), json.loads(match.group(2))))
    except ValueError:
        return len(text), []
    return (at, calls) if calls else (len(text), [])


def _llama3_json(text: str) -> tuple[int, Calls]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return len(text), []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return len(text), []
        call = _named(value, "parameters")
        if call is None:
            return len(text), []
        calls.append(call)
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return 0, calls


HERMES = ToolParser("hermes", "<tool_call>", _hermes)
MISTRAL = ToolParser("mistral", MISTRAL_TAG, _mistral, keeps_special_tokens=True)
LLAMA3_JSON = ToolParser("llama3_json", PYTHON_TAG, _llama3_json, whole_message=True)
BY_NAME = {parser.name: parser for parser in (HERMES, MISTRAL, LLAMA3_JSON)}


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """The parser `name` (one of `PARSERS`); for `auto`, the one the template shows."""
    if name != "auto":
        return BY_NAME[name]
    template = chat_template or ""
    if MISTRAL.tag in template:
        return MISTRAL
    if LLAMA3_JSON.tag in template or "ipython" in template:
        return LLAMA3_JSON
    return HERMES


class HeldContent:
    """(a streamed choice under `auto`) The content it can send as it comes: its text
    up to where a call may begin, as its parser reads it."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` sent
        self.held = False  # a call may have begun: the rest waits for the end

    def feed(self, text: str) -> str:
        """Take more text; the part that can go out now."""
        self.text += text
        if self.held:
            return ""
        end = self.parser.held_from(self.text, self.sent)
        if end < len(self.text) and self.parser.opens_call(self.text[end:]):
            self.held = True
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece

    def rest(self, text: str) -> str:
        """At the end, with the whole `text`: the content still to send (up to the
        first call, or all of it without one)."""
        first, _calls = self.parser.calls(text)
        return text[self.sent : first]


#: The head of a call in the JSON formats (Hermes', Mistral's array, Llama 3's): its
#: name, then the key of its arguments, and the first character of their value.
CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


class CallStream:
    """(a streamed choice under `auto`) The calls in the text `held` holds back, as
    they come: a call's name once its head is whole (`CALL_HEAD`), then its arguments'
    JSON text as the model writes it, up to the object's close, in OpenAI's stream
    deltas (vLLM's parsers stream so too). A call whose name does not come first, or
    whose arguments are not an object (Mistral's `name[ARGS]` form), streams nothing
    from there on: `rest` sends it, and those after it, whole at the end. A call is
    streamed only once its head is read, so text that never becomes one stays content."""

    def __init__(self, held: HeldContent, *, single: bool = False) -> None:
        self.held = held
        self.single = single  # parallel_tool_calls: false: one call at most
        self.opened = 0  # calls whose names went out
        self._look_from: int | None = None  # where the next call's head may begin
        self._sent_to: int | None = None  # the open call's arguments, sent up to here
        self._depth = 0  # the open arguments' nesting, strings and escapes
        self._in_string = False
        self._escaped = False
        self._stopped = False

    def advance(self) -> list[dict[str, Any]]:
        """The deltas for what the held text gained since the last call."""
        held = self.held
        if not held.held:
            return []
        text = held.text
        if self._look_from is None:
            self._look_from = held.sent  # where the content stopped
        deltas: list[dict[str, Any]] = []
        while not self._stopped:
            if self._sent_to is None:
                head = CALL_HEAD.search(text, self._look_from)
                if head is None:
                    break
                if text[head.end()] != "{" or (self.single and self.opened):
                    self._stopped = True  # the rest goes out whole at the end
                    break
                name = json.loads(f'"{head.group(1)}"')
                deltas.append({"index": self.opened, **tool_call(name, "")})
                self.opened += 1
                self._sent_to, self._depth = head.end(), 0
            end, closed = self._scan(text)
            if end > self._sent_to:
                piece = {"arguments": text[self._sent_to : end]}
                deltas.append({"index": self.opened - 1, "function": piece})
                self._sent_to = end
            if not closed:
                break
            self._look_from, self._sent_to = end, None
        return deltas

    def _scan(self, text: str) -> tuple[int, bool]:
        """How far the open arguments reach in `text`, and whether they closed there."""
        assert self._sent_to is not None
        for at in range(self._sent_to, len(text)):
            char = text[at]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return at + 1, True
        return len(text), False

    def rest(self, calls: Calls) -> Calls:
        """At the end, of the calls the whole text holds: those not streamed, each
        with its index."""
        return [
            {"index": index, **call} for index, call in enumerate(calls) if index >= self.opened
        ]
