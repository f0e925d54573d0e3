"""Log-probabilities of sampled or given tokens, with each one's top k and rank.

They are vLLM's default ("raw_logprobs"): the log-softmax of the model's own logits,
before the allowed set, the bias, the penalties, the grammar, temperature, min-p, top-k
and top-p (`sampling.py` applies those to its own copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kvscope.params import SamplingParams


@attrs.frozen
class TokenLogprobs:
    """The chosen token's log-probability and the `k` most likely tokens' (best first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    #: 1 + how many tokens are more likely than the chosen one (vLLM's `rank`).
    rank: int | None = None


def logprobs_of(
    logits: torch.Tensor, tokens: list[int], params: Sequence[SamplingParams], rows: list[int]
) -> list[TokenLogprobs]:
    """The raw log-probabilities of the chosen tokens of `rows` and their top k, or
    the tokens their `logprob_token_ids` name in the place of the top k."""
    chosen = logits[torch.tensor(rows, device=logits.device)]
    pinned = [params[r].logprob_token_ids for r in rows]
    ks = [0 if ids else params[r].logprobs or 0 for r, ids in zip(rows, pinned, strict=True)]
    found = token_logprobs(chosen, [tokens[r] for r in rows], ks)
    if not any(pinned):
        return found
    for j, ids in enumerate(pinned):
        if ids:
            row = torch.log_softmax(chosen[j].float(), dim=-1)
            values = row[torch.tensor(ids, device=logits.device)].tolist()
            found[j] = attrs.evolve(found[j], top=tuple(zip(ids, values, strict=True)))
    return found


def token_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row i's log-probability of `targets[i]` and its `ks[i]` most likely tokens (-1,
    or more than there are: all of them)."""
    device = logits.device
    vocab = logits.shape[-1]
    ks = [vocab if k < 0 else min(k, vocab) for k in ks]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_ids = torch.tensor(targets, device=device).unsqueeze(1)
    chosen_values = logprobs.gather(1, target_ids)
    chosen = chosen_values.squeeze(1).tolist()
    ranks = ((logprobs > chosen_values).sum(dim=-1) + 1).tolist()
    k = max(ks, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_ids_list, top_values_list = top_ids.tolist(), top_values.tolist()
    return [
        TokenLogprobs(
            chosen[j],
            tuple(zip(top_ids_list[j][:n], top_values_list[j][:n], strict=True)),
            ranks[j],
        )
        for j, n in enumerate(ks)
    ]
