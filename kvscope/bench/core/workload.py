"""The benchmark workload: distinct seeded prompts given as token ids.

Prompts are token ids, not text, so kvscope, `transformers` and vLLM see exactly the
same tokens (no tokenizer round trip). Every prompt is distinct from its first token,
so no prefix is shared and the prefix cache cannot make one request cheaper than another.
"""

from __future__ import annotations

import random
import time
from typing import Any

import attrs

#: Every system's requests are greedy unless the run asks otherwise.
GREEDY: dict[str, Any] = {"temperature": 0.0}


@attrs.frozen
class Workload:
    prompts: list[list[int]]
    max_tokens: int
    #: The sampling fields every request sends, the same for every system.
    sampling: dict[str, Any] = attrs.field(factory=lambda: dict(GREEDY))

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def make_prompts(
    count: int, length: int, vocab_size: int, *, seed: int = 0, first_id: int = 3
) -> list[list[int]]:
    """`count` distinct prompts of `length` token ids in [first_id, vocab_size)."""
    rng = random.Random(seed)
    span = vocab_size - first_id
    prompts = []
    for i in range(count):
        # The first token differs between prompts (while there are ids to spare).
        head = first_id + (i * 7919) % span
        prompts.append([head] + [first_id + rng.randrange(span) for _ in range(length - 1)])
    return prompts


def vocab_size_of(model: str) -> int:
    """The token ids a prompt may use, for a model name as `Engine.open` takes it: a
    checkpoint directory, a GGUF file (or a short name for one), or a built-in name."""
    if model == "tiny-random":
        return 256  # bytes only; BOS and EOS stay out of prompts
    import json
    from pathlib import Path

    from . import gguf_model

    if model == "bundled":
        from kvscope.models.loader import BUNDLED_DIR

        model = str(BUNDLED_DIR)
    model = gguf_model.resolve(model)
    if (file := gguf_model.gguf_file(model)) is not None:
        return gguf_model.vocab_size(file)
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


class Deadline:
    """A wall-clock bound for loops: `while not deadline.passed: ...`."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end

    @property
    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())
