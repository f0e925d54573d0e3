"""Reasoning split from the answer: what a thinking model writes between `<think>` and
`</think>` (vLLM's `--reasoning-parser`).

* `qwen3` (Qwen3, QwQ): an output that begins with `<think>` reasons up to
  `</think>` (all of it, if the tag never comes: cut short); any other output is all
  answer (thinking turned off, `enable_thinking: false`).
* `deepseek_r1` (DeepSeek-R1 and its distills, whose template opens the `<think>`
  in the prompt): the output reasons up to `</think>` (a leading `<think>` dropped),
  all of it if the tag never comes.

The answer after the end tag is the message's content; the reasoning goes beside it
(`reasoning_content` on the chat routes, a `reasoning` item in the Responses API).
`none` (the default, as vLLM's) leaves the text whole. A stream splits as it goes
(`ReasoningStream`), holding back only an end that may be the start of a tag, so the
pieces sent add up to the same split as the whole text's.
"""

from __future__ import annotations

import attrs

from .tool_calls import tag_tail

#: The parsers `--reasoning-parser` names.
PARSERS = ("none", "qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


@attrs.frozen
class ReasoningParser:
    name: str

    @property
    def splits(self) -> bool:
        return self.name != "none"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """The reasoning and the answer of a whole output (None for either if absent)."""
        if not self.splits:
            return None, text
        head = text.lstrip()
        if self.name == "qwen3" and not head.startswith(START):
            return None, text
        body = head.removeprefix(START)
        reasoning, ended, answer = body.partition(END)
        return reasoning or None, (answer if ended and answer else None)


class ReasoningStream:
    """(a streamed choice) Its text as it comes, told apart into reasoning and answer;
    `feed` returns the pieces that can go out now."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` accounted for
        # Where the text is: "start" (nothing decided yet), "reasoning" or "answer".
        self.state = "start" if parser.splits else "answer"

    def feed(self, text: str) -> tuple[str, str]:
        """More of the output: the reasoning and the answer to send now."""
        self.text += text
        if self.state == "start" and not self._opened():
            return "", ""
        reasoning = ""
        if self.state == "reasoning":
            at = self.text.find(END, self.sent)
            if at < 0:
                end = len(self.text) - tag_tail(self.text, END)
                reasoning, self.sent = self.text[self.sent : end], max(self.sent, end)
                return reasoning, ""
            reasoning = self.text[self.sent : at]
            self.sent, self.state = at + len(END), "answer"
        answer, self.sent = self.text[self.sent :], len(self.text)
        return reasoning, answer

    def _opened(self) -> bool:
        """Decide how the output opens, once it can be told: with `<think>` (reasoning
        follows), or without (qwen3: all answer; deepseek_r1: reasoning all the same)."""
        rest = self.text[self.sent :]
        head = rest.lstrip()
        if not head or (START.startswith(head) and head != START):
            return False  # blank, or maybe the tag's start
        blanks = len(rest) - len(head)  # before reasoning, not kept (as `split`)
        if head.startswith(START):
            self.sent += blanks + len(START)
            self.state = "reasoning"
        elif self.parser.name == "qwen3":
            self.state = "answer"  # the whole text is the answer, its blanks too
        else:
            self.sent += blanks
            self.state = "reasoning"
        return True

    def finish(self) -> tuple[str, str]:
        """At the end: what was held back (a partial tag is text after all)."""
        rest, self.sent = self.text[self.sent :], len(self.text)
        if self.state == "answer" or (self.state == "start" and self.parser.name == "qwen3"):
            return "", rest
        return rest, ""


NONE = ReasoningParser("none")
