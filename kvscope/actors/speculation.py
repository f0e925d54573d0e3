"""Speculative decoding's side in the step actor: which rows propose tokens, what they
propose (n-gram prompt lookup), and the counts of drafts and accepted tokens.

Before each step is scheduled, every running row that decodes and may speculate gets
a draft (`Sequence.draft`): the tokens that followed the latest earlier occurrence of
its last `prompt_lookup_max` (down to `prompt_lookup_min`) tokens, in its prompt and
output, at most `num_speculative_tokens` of them and fewer while its recent drafts
were cut short (`RowDrafter`). The scheduler gives the row one slot
a draft token more; the runner verifies the draft in the same forward (each of the
row's positions gets its logits) and answers with the draft's prefix that the model
would have drawn itself, plus the token after it (`kernels/speculative.py`). So a step
makes 1 to k + 1 tokens of such a row.

A row speculates only where that is simple to keep: with nothing that changes the
logits or reads them back (penalties, a bias, a guide, logprobs, prompt scores, an
embedding). Others decode one token a step as before, in the same batch. Greedy or
sampled, a row draws the tokens plain decoding draws (`kernels/speculative.py`).
With more requests running or waiting than `disable_by_batch_size` nobody speculates.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvscope.config import SpeculativeConfig

from .sequence import Sequence

#: N-gram ends a row's index takes in a step: a long prompt (~1 ms per 1,000 tokens to
#: index) is taken over several steps, which decode without a draft meanwhile, rather
#: than stalling the event loop, and every cancel behind it, in one.
INDEXED_PER_STEP = 4096


class NgramIndex:
    """Where each n-gram of a row's tokens (n from `min_n` to `max_n`) last occurred
    with a token after it, kept up to date as the row grows: a step's lookup costs a
    few dictionary reads, not a scan of the row (a scan was ~0.2-0.4 ms a row of 2,000
    tokens, on the event loop, every step)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._follows: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after
        self._indexed = 0  # n-grams ending before this index are in `_follows`

    def propose(self, tokens: Seq[int], k: int, budget: int | None = INDEXED_PER_STEP) -> list[int]:
        """The up to `k` tokens that followed the latest earlier occurrence of `tokens`'
        last n tokens, for the longest n that occurs; [] if none does, or while the
        index is still behind after taking `budget` more n-gram ends (None: all)."""
        length = len(tokens)
        if length < self._indexed:  # the row was cut (nothing does so today): start over
            self._follows.clear()
            self._indexed = 0
        stop = length - 1 if budget is None else min(length - 1, self._indexed + budget)
        for end in range(self._indexed, stop):  # each n-gram ending at `end`
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._follows[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, stop)
        if self._indexed < length - 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            follows = self._follows.get(tuple(tokens[length - n :]))
            if follows is not None:
                return list(tokens[follows : follows + k])
        return []


class RowDrafter:
    """One row's drafts: its n-gram index, and how long a draft it gets next. A row
    copies in stretches: where its last draft was taken whole the next may be twice as
    long (up to `num_speculative_tokens`); where it was cut at token a, the next is
    a + 1 long. Verifying a token costs nearly a decode step's share of compute on a
    CPU (a 6-row step is ~1.7x a 1-row one), so a row that is not copying drafts one
    token, not k, until it copies again."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        self.most = self.limit = config.num_speculative_tokens

    def propose(self, tokens: Seq[int], room: int) -> list[int]:
        return self.index.propose(tokens, min(room, self.limit))

    def verified(self, drafted: int, accepted: int) -> None:
        """Its last draft of `drafted` tokens had its first `accepted` taken."""
        if drafted:
            self.limit = min(self.most, 2 * drafted) if accepted == drafted else accepted + 1


def propose_ngram(tokens: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """`NgramIndex.propose` on `tokens` alone, indexed whole."""
    return NgramIndex(min_n, max_n).propose(tokens, k, budget=None)


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
                if seq.drafter is None:
                    seq.drafter = RowDrafter(config)
                seq.draft = seq.drafter.propose(seq.tokens, room)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """`seq` verified a draft of `drafted` tokens, `accepted` of them taken."""
        if not drafted:
            return
        if seq.drafter is not None:
            seq.drafter.verified(drafted, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
