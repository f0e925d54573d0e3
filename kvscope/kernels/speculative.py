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

Sampled rows draw each position's token as decoding draws it (`sampling.distribution`:
temperature, min-p, top-k, top-p; one uniform number from the row's generator, by
`inverse_cdf`) and take the draft's token where the draw equals it: the first draw that
differs is the token after the accepted ones, and the draft ends there. Each token is
then drawn from exactly the model's distribution (a draft token is taken with
probability p(d), and a token that is not it comes from p without d, renormalized: the
rejection-sampling rule for a draft that proposes one token for sure, Leviathan et al.
2023), and a seeded request draws the same numbers, one a token, and so the same
tokens as without speculation.
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
    finite = torch.isfinite(probs.sum(dim=-1)).tolist()
    accepted: list[int] = []
    for position in range(logits.shape[0]):
        u = uniform(generator, logits.device)  # one a token, as `sampling.sample` draws
        if finite[position]:
            token = inverse_cdf(probs[position : position + 1], u[None])[0]
        else:  # overflowed logits: the most likely token, as `sample` takes it
            token = int(x[position].argmax())
        if position == len(draft) or token != draft[position]:
            return accepted, token
        accepted.append(token)
    raise AssertionError("unreachable: the last position returns")
