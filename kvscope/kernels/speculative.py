"""Verifying a speculative draft: which of its tokens the model would have drawn.

Greedy rows:

A row that verifies a draft of k tokens has k + 1 positions in the step: its last
accepted token and the draft. Position i's logits are the model's next-token
distribution after the draft's first i tokens, so greedy decoding would have drawn
the argmax of position 0, then (had that been draft[0]) of position 1, and so on:
the accepted tokens are the draft's longest prefix equal to those argmaxes, and the
token after them is the argmax at the first position that disagrees (or, all accepted,
at the last). The output is the one greedy decoding gives one token at a time
(`argmax` as `sampling.sample` takes it: the first of equal maxima).

Sampled rows, by rejection sampling, which keeps each token's distribution exactly the
model's (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", 2023). An n-gram draft proposes one token for sure (q(d) = 1), so draft token
d at position i is accepted with probability p_i(d), p_i the row's distribution there
(temperature, min-p, top-k, top-p: `sampling.distribution`); where it is rejected, the
token is drawn from p_i without d (renormalized), and the draft ends. All accepted, the
token after them is drawn from the last position's p. Every uniform number comes from
the row's own generator, so a seeded request draws the same tokens each time; not the
ones it draws without speculation, which takes fewer numbers from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvscope.params import SamplingParams

from .sampling import distribution, inverse_cdf, uniform


def verify_greedy(logits: torch.Tensor, draft: Sequence[int]) -> tuple[list[int], int]:
    """(accepted draft tokens, the token after them) for `logits` of the draft's
    `len(draft) + 1` positions ([positions, vocab])."""
    assert logits.shape[0] == len(draft) + 1, "one position per draft token, and one more"
    best = logits.max(dim=-1).indices.tolist()
    accepted = 0
    while accepted < len(draft) and best[accepted] == draft[accepted]:
        accepted += 1
    return list(draft[:accepted]), best[accepted]


def verify_sampled(
    logits: torch.Tensor,
    draft: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """`verify_greedy` for a row that samples with `params` (see the module)."""
    assert logits.shape[0] == len(draft) + 1, "one position per draft token, and one more"
    probs, x = distribution(logits, [params] * logits.shape[0])
    if not bool(torch.isfinite(probs.sum()).item()):  # overflowed logits: as `sample` does
        return verify_greedy(x, draft)
    accepted: list[int] = []
    for position, token in enumerate(draft):
        row = probs[position]
        if float(uniform(generator, logits.device)) < float(row[token]):
            accepted.append(token)
            continue
        rest = row.clone()
        rest[token] = 0.0  # p without the rejected token: (p - q)+ for q one-hot at it
        return accepted, _draw_one(rest, generator)
    return accepted, _draw_one(probs[len(draft)], generator)


def _draw_one(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return inverse_cdf(probs[None, :], uniform(generator, probs.device)[None])[0]
