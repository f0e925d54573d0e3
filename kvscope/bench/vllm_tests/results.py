"""The outcome of each of vLLM's tests against each server: read from pytest's JUnit XML,
kept as records (the `--json` file), printed as one markdown table with a column a server
(docs/vllm-tests.md, "Results").
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import attrs

from ..core.machine import Machine
from ..core.records import FORMAT, Record

#: The dotted prefix pytest gives the test modules' names in the XML.
MODULE_PREFIX = "tests.entrypoints.openai."

#: How much of a failure's message the table and the JSON keep.
MESSAGE_CHARS = 240

#: An outcome (JUnit's element for it, or "passed" for none) and the word the table shows.
OUTCOME_OF = {"failure": "failed", "error": "error", "skipped": "skipped"}


@attrs.frozen
class Outcome(Record):
    """One test against one server: passed, failed, error or skipped, and why not."""

    outcome: str
    message: str = ""


@attrs.frozen
class Launch(Record):
    """One server a test file started: its command, and the flags of the test's `vllm
    serve` command line that `kvscope serve` does not take (left out of `argv`)."""

    argv: list[str]
    dropped: list[str] = attrs.field(factory=list)


@attrs.frozen
class ServerRun(Record):
    """vLLM's tests against one server: what was started, pytest's exit status, the
    seconds it took and each test's outcome."""

    server: str
    model: str
    returncode: int
    seconds: float
    launches: list[Launch]
    outcomes: dict[str, Outcome]


@attrs.frozen
class Report(Record):
    """The `--json` file: the vLLM release whose tests ran, the machine, one run a server."""

    vllm_version: str
    tests: list[str]
    machine: Machine
    runs: list[ServerRun]
    format: int = FORMAT


def test_id(classname: str, name: str) -> str:
    """`chat_completion/test_chat.py::test_x[param]` from JUnit's classname and name."""
    parts = classname.removeprefix(MODULE_PREFIX).split(".")
    classes: list[str] = []
    while parts and parts[-1][:1].isupper():  # a test class inside the module
        classes.insert(0, parts.pop())
    return "::".join(["/".join(parts) + ".py", *classes, name])


def one_line(text: str) -> str:
    """A failure message's first non-empty line, shortened to MESSAGE_CHARS."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return first if len(first) <= MESSAGE_CHARS else first[: MESSAGE_CHARS - 1] + "…"


def read_junit(path: Path) -> dict[str, Outcome]:
    """Each test's outcome in a JUnit XML file, by test id."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = Outcome("passed")
        for child in case:
            if child.tag in OUTCOME_OF:
                text = child.get("message") or child.text or ""
                outcome = Outcome(OUTCOME_OF[child.tag], one_line(text))
                break
        outcomes[test_id(case.get("classname", ""), case.get("name", ""))] = outcome
    return outcomes


def counts(outcomes: dict[str, Outcome]) -> dict[str, int]:
    found: dict[str, int] = {}
    for outcome in outcomes.values():
        found[outcome.outcome] = found.get(outcome.outcome, 0) + 1
    return dict(sorted(found.items()))


def table(runs: list[ServerRun]) -> str:
    """Markdown: a row a test, a column a server, then the first server's failure."""
    columns = {run.server: run.outcomes for run in runs}
    servers = list(columns)
    tests = sorted({test for outcomes in columns.values() for test in outcomes})
    head = ["test", *servers, f"{servers[0]}: why not"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for test in tests:
        cells = [columns[s].get(test, Outcome("-")).outcome for s in servers]
        why = columns[servers[0]].get(test, Outcome("-")).message.replace("|", "\\|")
        rows.append("| " + " | ".join([f"`{test}`", *cells, why]) + " |")
    totals = ", ".join(
        f"{server}: " + " ".join(f"{k} {v}" for k, v in counts(columns[server]).items())
        for server in servers
    )
    return "\n".join([*rows, "", totals])
