"""Speculative decoding's side in the step actor: which rows propose tokens, what they
propose (n-gram prompt lookup), and the counts of drafts and accepted tokens.

Before each step is scheduled, every running row that decodes and may speculate gets
a draft (`Sequence.draft`): the tokens that followed the latest earlier occurrence of
its last `prompt_lookup_max` (down to `prompt_lookup_min`) tokens, in its prompt and
output, at most `num_speculative_tokens` of them. The scheduler gives the row one slot
a draft token more; the runner verifies the draft in the same forward (each of the
row's positions gets its logits) and answers with the draft's prefix that the model
would have drawn itself, plus the token after it (`kernels/speculative.py`). So a step
makes 1 to k + 1 tokens of such a row.

A row speculates only where that is simple to keep: with nothing that changes the
logits or reads them back (penalties, a bias, a guide, logprobs, prompt scores, an
embedding). Others decode one token a step as before, in the same batch. A greedy row
draws the tokens of plain decoding; a sampled one draws from the same distribution by
rejection sampling (`kernels/speculative.py`).
With more requests running or waiting than `disable_by_batch_size` nobody speculates.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from kvscope.config import SpeculativeConfig

from .sequence import Sequence


def propose_ngram(tokens: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of `tokens`'
    last n tokens, for the longest n in `max_n`..`min_n` that occurs; [] if none does."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = array[length - n :]
        # Windows that start before the pattern itself and are followed by a token.
        windows = np.lib.stride_tricks.sliding_window_view(array[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            follows = int(hits[-1]) + n
            return array[follows : follows + k].tolist()
    return []


def may_speculate(seq: Sequence) -> bool:
    """Whether `seq`'s next step may verify a draft (see the module)."""
    params = seq.params
    state = getattr(seq.owner, "sampling", None)
    return (
        not params.processed
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not params.embed
        and (state is None or state.guide is None)
        and len(seq.tokens) - seq.num_computed == 1  # decoding, not prefilling
    )


class Speculation:
    """The drafts of one engine's rows, and how many of their tokens were accepted."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        #: Accepted tokens by their position in the draft (vLLM's `..._per_pos`).
        self.accepted_per_position = [0] * config.num_speculative_tokens

    @classmethod
    def of(cls, config: SpeculativeConfig | None) -> Speculation | None:
        return None if config is None else cls(config)

    def propose(self, running: Seq[Sequence], waiting: int) -> None:
        """Give each running row that may speculate its draft (see the module); none
        where the running and `waiting` requests are more than `disable_by_batch_size`
        (the waiting ones join the batch as it has room)."""
        config = self.config
        limit = config.disable_by_batch_size
        everyone = limit is None or len(running) + waiting <= limit
        for seq in running:
            seq.draft = []
            if not everyone or seq.skippable() or not may_speculate(seq):
                continue
            # Never past max_tokens, the bonus token included (admission fitted
            # max_tokens to the context).
            room = min(seq.params.max_tokens - seq.num_generated - 1, config.num_speculative_tokens)
            if room > 0:
                seq.draft = propose_ngram(
                    seq.tokens, room, config.prompt_lookup_min, config.prompt_lookup_max
                )

    def record(self, drafted: int, accepted: int) -> None:
        """A row verified a draft of `drafted` tokens, `accepted` of them taken."""
        if not drafted:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted ones (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
