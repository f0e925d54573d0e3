"""The bundled default model: it ships in the package, loads in a few seconds, fits
the size budget, and its greedy output is mostly English words.

Skipped (with the reason) while kvscope/models/bundled/ holds no model.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch

from kvscope.models.loader import BUNDLED_DIR, load_model

pytestmark = pytest.mark.skipif(
    not (BUNDLED_DIR / "config.json").is_file(), reason=f"no bundled model in {BUNDLED_DIR} yet"
)

PROMPTS = [
    "Once upon a time",
    "The function returns",
    "In this module, the",
    "Permission is hereby granted",
    "A list is",
]

# Common English words, and the everyday words of the texts the model was trained on
# (Python's documentation and free-software licences). A word the model makes up, or
# a fragment of one, is in none of them.
WORDS = set(
    """
    a about above after again against all also always an and another any are as at be
    because been before being below between both but by can cannot could did do does
    doing done down during each either else even every few first for from further get
    given gives had has have having he her here him his how however i if in instead
    into is it its itself just last least less like long made make many may me might
    more most much must my name names need never new next no nor not now of off often
    old on once one only or other others otherwise our out over own part per same see
    seen she should since so some such than that the their them then there these they
    this those though three through thus time times to too two under until up upon us
    use used uses using very was way we well were what when where whether which while
    who whom whose why will with within without would yet you your
    argument arguments attribute attributes block built byte bytes call called calls
    case class classes code command constant contains copy data default defined
    defines definition dictionary directory error errors example exception exceptions
    expression expressions false file files following float format function functions
    global identifier import in instance instances integer integers interpreter item
    items key keys keyword language line lines list lists local method methods module
    modules none number numbers object objects operation operations operator operators
    optional order parameter parameters path print program python raise raised range
    reference result return returned returns sequence sequences set sets statement
    statements string strings syntax system true tuple tuple type types unicode value
    values variable variables version
    agreement author authors conditions copyright copyrights covered distribute
    distributed distribution free freedom general granted gnu hereby holder holders
    license licensed licenses liability modify modified permission permitted provided
    public program redistribute redistribution rights software source terms warranty
    work works any without including limited merchantability fitness purpose notice
    above following shall so subject person persons obtaining furnished whom
    add added allow allows change changes create created different end example
    following given include includes including information kind number point possible
    present provide provides same set special specific specified standard support
    supported usually value way when written
    """.split()
)


def words_of(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def test_bundled_model_fits_the_size_budget() -> None:
    size = sum(f.stat().st_size for f in BUNDLED_DIR.iterdir() if f.is_file())
    assert size <= 21 * 2**20, f"the bundled model takes {size / 2**20:.1f} MiB"


def test_bundled_model_loads_in_a_few_seconds() -> None:
    started = time.perf_counter()
    loaded = load_model("bundled", device=torch.device("cpu"))
    elapsed = time.perf_counter() - started
    assert elapsed < 5.0, f"loading took {elapsed:.1f} s"
    assert loaded.name == "bundled" and loaded.tokenizer.encode("Hello")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_bundled_greedy_output_is_mostly_english_words(open_engine: Any) -> None:
    outputs = []
    async with open_engine("bundled") as engine:
        for prompt in PROMPTS:
            out = await engine.generate(prompt, temperature=0, max_tokens=32)
            outputs.append(out.text)
    words = [w for text in outputs for w in words_of(text)]
    known = [w for w in words if w in WORDS]
    assert len(words) >= 10, outputs  # a prompt may stop early at the model's EOS
    assert len(known) / len(words) >= 0.5, (len(known) / len(words), outputs)
