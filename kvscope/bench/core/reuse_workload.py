"""The reuse workload: chats whose answers reuse their prompts, given as token ids.

Each request holds a code snippet of its own (seeded Python functions with made-up
names, opened by a constant whose name no other request of the run has), followed by
an instruction to repeat it: exactly, or with every variable renamed (the two
alternate). Code edits, quoted sources and summaries answer in spans of their prompt
so, and n-gram speculation (docs/speculative.md) guesses those spans. The chat is
rendered with the model's own chat template (a model without one: as kvscope serve's
chat route renders it, `role: content` lines) and tokenized by kvscope's tokenizer for
the model (`models.loader.tokenizer_of`), so every system sees the same token ids.
Prompts share at most the template's head and the instruction sits after the
snippet, so no prompt finds another's blocks in a prefix cache.

A snippet holds at least `answer_tokens` tokens (the run's `--max-tokens`), so the
answer the levels measure is the repeat itself. Requests keep `ignore_eos`, as the
other workloads do: a system stopping at its end of turn would make fewer tokens than
another and its tokens/s would count different work; with the snippet as long as the
measured answer, the end of turn does not fall inside it.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import attrs

#: What each request asks of its snippet, in turn.
INSTRUCTIONS = (
    "Repeat the code above exactly, in one python code block, and nothing else.",
    "Repeat the code above with every variable renamed, in one python code block, "
    "and nothing else.",
)
_ADJECTIVES = (
    "quiet rapid hidden bright narrow silver frozen golden hollow gentle brave ancient "
    "crimson distant eager fierce humble lively mellow noble proud rustic steady tender "
    "vivid wild clever dusty empty sharp"
).split()
_NOUNS = (
    "count index total buffer record weight offset limit score price window margin "
    "signal cursor packet ledger sample bucket vector token length factor target source "
    "height budget stock queue frame chunk"
).split()
_VERBS = (
    "compute merge scale filter update collect measure shift balance rank split "
    "normalize tally trim blend"
).split()


@attrs.frozen
class ReusePrompt:
    token_ids: list[int]
    #: The code the request asks to repeat (its text, inside the prompt).
    snippet: str
    instruction: str


def reuse_prompts(
    model: str, count: int, answer_tokens: int, *, seed: int = 0, start: int = 0
) -> list[ReusePrompt]:
    """`count` distinct reuse prompts for `model` (a name as `Engine.open` takes it),
    each snippet at least `answer_tokens` tokens; `start`: the index of the first, so
    that the prompts of several calls of one run open with different names."""
    tokenizer, template = tokenizer_and_template(model)
    rng = random.Random(seed)
    out = []
    for i in range(start, start + count):
        snippet = code_snippet(rng, i, answer_tokens, tokenizer)
        instruction = INSTRUCTIONS[i % len(INSTRUCTIONS)]
        ids = chat_token_ids(tokenizer, template, f"{snippet}\n{instruction}")
        out.append(ReusePrompt(ids, snippet, instruction))
    return out


@functools.cache
def tokenizer_and_template(model: str) -> tuple[Any, str | None]:
    """The model's tokenizer and chat template (read once per run: a GGUF file's
    tokenizer takes seconds to build)."""
    from kvscope.models.loader import tokenizer_of

    return tokenizer_of(model)


def chat_token_ids(tokenizer: Any, template: str | None, text: str) -> list[int]:
    """One user turn holding `text`, with the assistant's turn opened, as token ids."""
    if template is None:  # kvscope serve's rendering of a chat for a model without one
        return tokenizer.encode(f"user: {text}\nassistant:", add_special_tokens=True)
    from kvscope.models.loaded import chat_text

    rendered = chat_text(template, tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False)  # the template holds them


def code_snippet(rng: random.Random, index: int, min_tokens: int, tokenizer: Any) -> str:
    """Python source of at least `min_tokens` tokens: a constant named after `index`
    (distinct for the first 900 indices), then seeded functions using it."""
    adjective = _ADJECTIVES[index % len(_ADJECTIVES)]
    noun = _NOUNS[index // len(_ADJECTIVES) % len(_NOUNS)]
    constant = f"{adjective}_{noun}".upper()
    snippet = f"{constant} = {rng.randrange(2, 100)}\n"
    while True:
        snippet += "\n\n" + _function(rng, constant)
        if len(tokenizer.encode(snippet, add_special_tokens=False)) >= min_tokens:
            return snippet


def _name(rng: random.Random, taken: list[str]) -> str:
    while (name := f"{rng.choice(_ADJECTIVES)}_{rng.choice(_NOUNS)}") in taken:
        pass
    return name


def _function(rng: random.Random, constant: str) -> str:
    """One function of two arguments: a few statements over them and its locals."""
    args = [_name(rng, [])]
    args.append(_name(rng, args))
    names = list(args)
    first = _name(rng, names)
    lines = [f"{first} = {args[0]} * {rng.randrange(2, 10)} + {args[1]}"]
    names.append(first)
    for _ in range(rng.randrange(3, 6)):
        lines += _statement(rng, names, constant)
    lines.append(f"return {names[-1]} + {rng.choice(names)}")
    head = f"def {rng.choice(_VERBS)}_{rng.choice(_NOUNS)}({', '.join(args)}):"
    return "\n".join([head, *(f"    {line}" for line in lines)]) + "\n"


def _statement(rng: random.Random, names: list[str], constant: str) -> list[str]:
    """A statement (its lines, unindented) over `names`; may add a local to them."""
    x, y = rng.choice(names), rng.choice(names)
    n = rng.randrange(2, 50)
    kind = rng.randrange(4)
    if kind == 0:
        i = _name(rng, names)
        return [f"for {i} in range({n}):", f"    {x} += {i} * {y}"]
    if kind == 1:
        return [f"if {x} > {constant}:", f"    {x} = {x} % {n} - {y}"]
    if kind == 2:
        new = _name(rng, names)
        names.append(new)
        return [f"{new} = max({x}, {y} - {n})"]
    return [f"{x} = {x} // {n} + {constant}"]
