"""The structured-output budget (kernels/guide_limits.py): what would overflow the native
compiler's stack is refused by name before it runs, what the budget admits compiles in
the large-stack thread and runs to its end on an ordinary one."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest

from kvscope.kernels.guide_limits import (
    MAX_GRAMMAR_RULES,
    MAX_GUIDE_BYTES,
    MAX_GUIDE_NESTING,
    MAX_SCHEMA_REFS,
    check_budget,
    compile_isolated,
    nesting,
)
from kvscope.kernels.guided import Guide, GuideCompiler
from kvscope.models.tokenizer import ByteTokenizer
from kvscope.params import SamplingParams
from tests.guide_shapes import (
    as_text,
    lark_chain,
    nested_array_schema,
    nested_parens_grammar,
    nested_regex,
    schema_ref_chain,
)

VOCAB = 258  # the byte tokenizer's 256 bytes, BOS and EOS


@pytest.fixture(scope="module")
def compiler() -> GuideCompiler:
    return GuideCompiler(ByteTokenizer(), VOCAB)


def params(**guide: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, **guide)


GBNF_CHAIN = "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(1200))


@pytest.mark.parametrize(
    ("guide", "budget"),
    [
        ({"guided_grammar": lark_chain(3000)}, "max_grammar_rules"),  # the tester's crash
        ({"guided_json": schema_ref_chain(1000)}, "max_schema_refs"),  # the tester's crash
        ({"guided_grammar": GBNF_CHAIN}, "max_grammar_rules"),
        ({"guided_grammar": "start: %json " + as_text(schema_ref_chain(500))}, "max_schema_refs"),
        ({"guided_regex": "a" * (MAX_GUIDE_BYTES + 1)}, "max_guide_bytes"),
        ({"guided_choice": ["a" * MAX_GUIDE_BYTES]}, "max_guide_bytes"),
        ({"guided_regex": nested_regex(MAX_GUIDE_NESTING + 1)}, "max_guide_nesting"),
        ({"guided_grammar": nested_parens_grammar(MAX_GUIDE_NESTING + 1)}, "max_guide_nesting"),
        ({"guided_json": nested_array_schema(MAX_GUIDE_NESTING)}, "max_guide_nesting"),
    ],
)
def test_a_guide_over_the_budget_is_refused_naming_it(
    compiler: GuideCompiler, guide: dict[str, Any], budget: str
) -> None:
    field = next(iter(guide))
    with pytest.raises(
        ValueError, match=rf"^{field} is over the structured-output budget.*{budget}"
    ):
        compiler.check(params(**guide))
    with pytest.raises(ValueError, match=budget):  # and again, from the cache
        compiler.guide(params(**guide))


def test_the_budget_counts_rules_refs_and_brackets_outside_strings() -> None:
    assert nesting('start: "((((((" ("a" | /[(]/)', strings=True, classes=True) == 1
    assert nesting(r"\(\(\((a)[(][^]]", strings=False, classes=True) == 1  # characters all
    assert nesting('{"a": "}}}{{{", "b": [[1]]}', strings=True, classes=False) == 3
    check_budget("guided_grammar", lark_chain(MAX_GRAMMAR_RULES - 2))  # start, r0..rN
    with pytest.raises(ValueError, match=f"{MAX_GRAMMAR_RULES + 1} rule definitions"):
        check_budget("guided_grammar", lark_chain(MAX_GRAMMAR_RULES - 1))
    check_budget("guided_json", as_text(schema_ref_chain(MAX_SCHEMA_REFS - 1)))
    with pytest.raises(ValueError, match=f"{MAX_SCHEMA_REFS + 1} \\$refs"):
        check_budget("guided_json", as_text(schema_ref_chain(MAX_SCHEMA_REFS)))
    check_budget("guided_regex", "(" * 50 + "[(]" * 500 + ")" * 50)  # nothing over


def run_to_end(guide: Guide, prefer: bytes, steps: int = 20_000) -> bytes:
    """Drive `guide` to its end, taking the first byte of `prefer` it allows (so the
    deepest path), in a thread of the default stack size: its output."""
    out = bytearray()

    def drive() -> None:
        for _ in range(steps):
            if guide.done or guide.error is not None:
                return
            allowed = guide.allowed(VOCAB)
            assert allowed is not None
            token = next(t for t in prefer if allowed[t])
            guide.accept(token)
            out.append(token)

    worker = threading.Thread(target=drive)
    worker.start()
    worker.join()
    assert guide.error is None and guide.done
    return bytes(out)


def test_a_chain_at_the_budget_compiles_and_runs_to_its_end(compiler: GuideCompiler) -> None:
    rules = MAX_GRAMMAR_RULES - 2
    guide = compiler.guide(params(guided_grammar=lark_chain(rules)))
    assert guide is not None
    out = run_to_end(guide, prefer=b"x0123456789z")
    assert out == "".join(f"x{i}" for i in range(rules)).encode() + b"z"


def test_a_ref_chain_at_the_budget_compiles_and_runs_to_its_end(compiler: GuideCompiler) -> None:
    links = MAX_SCHEMA_REFS - 1
    guide = compiler.guide(params(guided_json=schema_ref_chain(links)))
    assert guide is not None
    out = run_to_end(guide, prefer=b'{"x:0}')
    value = json.loads(out)
    for _ in range(links):
        value = value["x"]
    assert isinstance(value, int)


def test_the_compile_thread_times_out_and_hands_back_errors() -> None:
    release = threading.Event()
    with pytest.raises(
        ValueError, match=r"guided_json took longer than 0\.05 s.*compile_timeout_s"
    ):
        compile_isolated(release.wait, "guided_json", timeout=0.05)
    release.set()

    def fail() -> None:
        raise ValueError("guided_regex cannot be compiled: no")

    with pytest.raises(ValueError, match="no"):
        compile_isolated(fail, "guided_regex")
    assert compile_isolated(lambda: 42, "guided_choice") == 42


CRASH = """
import sys, threading, llguidance
from kvscope.kernels.guide_limits import compile_isolated
from tests.guide_shapes import lark_chain
grammar = llguidance.LLMatcher.grammar_from_lark(lark_chain(3000))
def compile_chain():
    return llguidance.LLMatcher.validate_grammar(grammar)
if sys.argv[1] == "isolated":
    print(repr(compile_isolated(compile_chain, "guided_grammar")))
else:
    threading.stack_size(8 << 20)
    thread = threading.Thread(target=compile_chain)
    thread.start()
    thread.join()
"""


def test_the_compile_thread_survives_what_kills_a_default_stack() -> None:
    """llguidance 1.9.1 overflows an 8 MiB stack on a 3,000-rule chain (the process
    dies); the compile thread's stack holds it. Each runs in a child process."""

    def child(mode: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", CRASH, mode]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    isolated = child("isolated")
    assert isolated.returncode == 0, isolated.stderr
    assert isolated.stdout.strip() == "''"  # no error: the grammar is valid
    assert child("default").returncode < 0  # killed by a signal
