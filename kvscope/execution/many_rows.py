"""The outputs a step reads from several rows of one chunk, not only its last: a
prompt's scores (`prompt_logprobs`) and a speculative draft's verification.

Both take `head`, the model's output head over chosen rows of the step's hidden states
(`ModelRunner._sample` binds it), and each chunk's first row among those states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvscope.kernels.sampling import Sampled, TokenLogprobs, token_logprobs
from kvscope.kernels.speculative import verify_greedy, verify_sampled

from .step_input import ChunkInput

#: Prompt rows scored per pass of the output head: their float32 logits (and their
#: log-softmax) are this many vocabulary-wide rows: 128 MiB for a 128k vocabulary.
SCORED_ROWS_AT_ONCE = 256

Head = Callable[[list[int]], torch.Tensor]


def verify_drafts(
    chunks: list[ChunkInput], verified: list[tuple[int, int]], head: Head
) -> dict[int, Sampled]:
    """The accepted draft tokens and the token after them of each chunk that verifies
    a draft, by chunk, from the chunk's rows (its last token's and its draft's)."""
    if not verified:
        return {}
    rows = [r for i, first in verified for r in range(first, first + len(chunks[i].draft) + 1)]
    logits = head(rows)
    out, at = {}, 0
    for index, _ in verified:
        draft = chunks[index].draft
        chunk = chunks[index]
        rows_of_it = logits[at : at + len(draft) + 1]
        if chunk.params.greedy:
            accepted, token = verify_greedy(rows_of_it, draft)
        else:
            accepted, token = verify_sampled(rows_of_it, draft, chunk.params, chunk.generator)
        out[index] = Sampled(token, drafted=tuple(accepted))
        at += len(draft) + 1
    return out


def score_prompts(
    chunks: list[ChunkInput], scored: list[tuple[int, int]], head: Head
) -> dict[int, tuple[TokenLogprobs, ...]]:
    """The log-probabilities of each scored chunk's `prompt_targets`, by chunk, from
    the rows starting at its first row (the output head over a few hundred at once)."""
    if not scored:
        return {}
    rows: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    for index, first in scored:
        chunk = chunks[index]
        rows.extend(range(first, first + len(chunk.prompt_targets)))
        targets += chunk.prompt_targets
        ks += [chunk.params.prompt_logprobs or 0] * len(chunk.prompt_targets)
    values: list[TokenLogprobs] = []
    for at in range(0, len(rows), SCORED_ROWS_AT_ONCE):  # a vocabulary-wide row each
        piece = slice(at, at + SCORED_ROWS_AT_ONCE)
        values += token_logprobs(head(rows[piece]), targets[piece], ks[piece])
    out, at = {}, 0
    for index, _ in scored:
        count = len(chunks[index].prompt_targets)
        out[index] = tuple(values[at : at + count])
        at += count
    return out
