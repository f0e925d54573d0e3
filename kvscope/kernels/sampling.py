"""Token sampling from a step's logits, one row per sequence that samples.

Greedy rows are one batched `argmax`. Other rows apply temperature, top-k and top-p and
draw with the request's own `torch.Generator`, so a seeded request gives the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvscope.params import SamplingParams


def make_generator(seed: int | None, fallback_seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else fallback_seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Pick one token per row of `logits` ([rows, vocab], float32)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[row] = _draw(logits[row], p, generator)
    return tokens


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    row = row.float() / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already cover top_p; the first stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) > p.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if not torch.isfinite(probs).all():
        return int(row.argmax())  # logits that overflowed: the most likely token
    return int(torch.multinomial(probs, 1, generator=generator).item())
