"""Verifying a speculative draft: which of its tokens the model would have drawn.

A row that verifies a draft of k tokens has k + 1 positions in the step: its last
accepted token and the draft. Position i's logits are the model's next-token
distribution after the draft's first i tokens, so greedy decoding would have drawn
the argmax of position 0, then (had that been draft[0]) of position 1, and so on:
the accepted tokens are the draft's longest prefix equal to those argmaxes, and the
token after them is the argmax at the first position that disagrees (or, all accepted,
at the last). The output is the one greedy decoding gives one token at a time
(`argmax` as `sampling.sample` takes it: the first of equal maxima).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(logits: torch.Tensor, draft: Sequence[int]) -> tuple[list[int], int]:
    """(accepted draft tokens, the token after them) for `logits` of the draft's
    `len(draft) + 1` positions ([positions, vocab])."""
    assert logits.shape[0] == len(draft) + 1, "one position per draft token, and one more"
    best = logits.max(dim=-1).indices.tolist()
    accepted = 0
    while accepted < len(draft) and best[accepted] == draft[accepted]:
        accepted += 1
    return list(draft[:accepted]), best[accepted]
