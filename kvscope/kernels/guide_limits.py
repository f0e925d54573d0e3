"""The budget a client's grammar must fit, and the thread that compiles it.

llguidance (native code) compiles a grammar by recursion, and a deep enough one
overflows the thread's stack: a SIGSEGV that kills the whole server, every stream with
it. Measured with llguidance 1.9.1 on an 8 MiB stack (Linux's default for the main
thread and for Python's threads), the process dies at:

* a Lark chain of rules (`r0: "x0" r1 | "y"`, `r1: ...`): 2,687 rules (2,656 pass),
  about 3 KiB of stack a rule; a chain of bare aliases (`r0: r1`) the same;
* a JSON schema chaining `$defs` by `$ref`: 937 objects (`{"type": "object",
  "properties": {"x": {"$ref": ...}}}`, 921 pass), 1,093 arrays, 2,500 bare aliases:
  up to 9 KiB a link; the same schema inside a Lark grammar's `%json` as well.

What llguidance bounds itself, measured clean (an error, no crash): a Lark grammar's
parentheses (about 25 levels), a regex's nesting (250, regex-syntax's limit), a JSON
schema's own nesting (128 levels of JSON, serde's limit), and at run time the Earley
parser (a right-recursive grammar run 20,000 tokens deep; a row past 2,000 items is an
error) and the lexer (fuel and state limits, `PARSER_LIMITS`).

So two layers. The budget (`check_budget`, before anything native runs) admits at most
`MAX_GRAMMAR_RULES` rule definitions and `MAX_SCHEMA_REFS` `$ref`s, well under what
kills even an 8 MiB stack, `MAX_GUIDE_BYTES` of source and `MAX_GUIDE_NESTING` levels of
brackets; a request over it is a ValueError naming the budget (a 400). And
`compile_isolated` runs the native compile in a thread of its own with a
`COMPILE_STACK_BYTES` stack (32 times the default) under a `COMPILE_TIMEOUT_S` deadline:
even a chain the counts miss (a `$ref` spelled with a JSON escape in a `%json`) is
bounded by the size budget, at about 25 bytes a link some 5,300 links, 47 MiB of stack.
The compiled matcher computes its first mask there too (the lexer it builds is shared
by its copies), so an expensive lexer costs the compile's deadline, not a model step.
Requests' matchers are deep copies of it (kernels/guided.py): the step's worker thread
only computes masks and consumes tokens, which do not recurse with the grammar's depth
(a 20,000-rule chain, and a right-recursive grammar 20,000 tokens deep, run to the end
on an 8 MiB stack). The model worker process gets masks, never a matcher.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: The most source text a guide may have (a schema, a grammar, a regex, the choices).
MAX_GUIDE_BYTES = 128 * 1024
#: The most rule definitions a grammar may have (Lark `name:` or GBNF `name ::=`).
MAX_GRAMMAR_RULES = 1000
#: The most `$ref`s a schema (or a grammar's `%json`) may have.
MAX_SCHEMA_REFS = 400
#: The most levels of brackets (`(`, `[`, `{`) a guide may nest.
MAX_GUIDE_NESTING = 100
#: The compile thread's stack.
COMPILE_STACK_BYTES = 256 * 1024 * 1024
#: The longest one compile may take; a slower one is the request's 400. Within the budget
#: the slowest measured take under 0.5 s (a 129 KB regex of 14,000 alternatives: 0.4 s).
COMPILE_TIMEOUT_S = 5.0
#: llguidance's own resource limits (`LLParserLimits`), in one place to tune: Earley
#: items a row and a step, lexer fuel to build and a step, lexer states, grammar symbols.
#: Its defaults, save the fuel to build the lexer: 1,000,000 let a 19-byte regex
#: (`a{100}{100}{100}`) spend 1.4 to 8 s (on 2 busy cores) on its first mask, where
#: 200,000 refuses it in 0.08 s and still builds a 300-property schema, 2,000 choices,
#: `.{0,2000}` or an e-mail regex in under 10 ms.
PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2000,
    "step_max_items": 50_000,
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 200_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
}

_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.M)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_ESCAPE = re.compile(r"\\.", re.S)
_CLASS = re.compile(r"\[[^\[\]{}]*\]")
_NOT_BRACKET = re.compile(r"[^()\[\]{}]+")
# `threading.stack_size` is process-wide: set, start, reset under one lock.
_stack_lock = threading.Lock()


def check_budget(field: str, source: str) -> None:
    """ValueError naming the budget if `source` (the text of `field`) is over it."""
    size = len(source.encode("utf-8", "surrogatepass"))
    _at_most(field, "bytes of source", size, MAX_GUIDE_BYTES, "max_guide_bytes")
    if field == "guided_grammar":
        rules = len(_RULE.findall(source))
        _at_most(field, "rule definitions", rules, MAX_GRAMMAR_RULES, "max_grammar_rules")
    if field in ("guided_json", "guided_grammar"):
        refs = source.count('"$ref"')
        _at_most(field, "$refs", refs, MAX_SCHEMA_REFS, "max_schema_refs")
    regex = field in ("guided_regex", "guided_grammar")  # Lark's terminals are regexes
    depth = nesting(source, strings=field != "guided_regex", classes=regex)
    _at_most(field, "levels of nested brackets", depth, MAX_GUIDE_NESTING, "max_guide_nesting")


def _at_most(field: str, what: str, count: int, limit: int, name: str) -> None:
    if count > limit:
        raise ValueError(
            f"{field} is over the structured-output budget: it has {count} {what}, "
            f"at most {limit} ({name})"
        )


def nesting(text: str, *, strings: bool, classes: bool) -> int:
    """The deepest nesting of brackets in `text`, escaped ones left out; with `strings`
    the contents of double-quoted strings (JSON's and Lark's) too, and with `classes`
    a regex's character classes (`[(]` is one character)."""
    if strings:
        text = _STRING.sub("", text)
    text = _ESCAPE.sub("", text)
    if classes:
        text = _CLASS.sub("", text)
    brackets = _NOT_BRACKET.sub("", text)
    depth = deepest = 0
    for char in brackets:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif depth:
            depth -= 1
    return deepest


def compile_isolated(work: Callable[[], T], what: str, timeout: float = COMPILE_TIMEOUT_S) -> T:
    """`work()` (a native compile) run in a new thread with a `COMPILE_STACK_BYTES`
    stack: its result, or what it raised; a ValueError naming `what` if it takes longer
    than `timeout` s (the thread is left to finish; llguidance's fuel limits bound it)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"kvscope-compile-{what}", daemon=True)
    with _stack_lock:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join(timeout)
    if not outcome:
        raise ValueError(
            f"{what} took longer than {timeout:g} s to compile, the "
            "structured-output budget (compile_timeout_s)"
        )
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def parser_limits() -> Any:
    """`PARSER_LIMITS` as llguidance takes them."""
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)
