"""How many pieces a prefill's attention is cut into, so that the forward's next
checkpoint is never far away (the linear layers' pieces: `kernels/slicing.py`).

A prefill's attention is cut as a long linear layer is (`attention_parts`,
`kernels.attention`): the chunks of a step into pieces of nearly equal work, of rows (a cut may fall inside a
chunk) for the compiled in-place kernel, of whole chunks for SDPA's chunks that start
their sequences, and of rows for SDPA's other chunks. Its cost is
learned as it runs, per path: seconds per key attended, an exponential average of
each piece's own (`ATTENTION_FOLLOW`), one piece until a piece was timed.
"""

from __future__ import annotations

import math

#: How far the learned seconds per key of a prefill's attention move toward each
#: piece's own (an exponential average: one slow piece, preempted, moves it little).
ATTENTION_FOLLOW = 0.2


class AttentionSlicer:
    """The pieces of a prefill's attention for a `target` of seconds a piece
    (`kernels.attention.PrefillSlicing`), from the cost learned per path."""

    def __init__(self, target: float) -> None:
        self.target = target
        #: Seconds a prefill's attention takes per key attended, by path (learned).
        self._key_seconds: dict[str, float] = {}

    def attention_parts(self, path: str, keys: int) -> int:
        """How many pieces a prefill's attention over `keys` keys in all (its rows'
        keys summed) is cut into on `path`: one until a piece on it was timed."""
        rate = self._key_seconds.get(path)
        return 1 if rate is None else max(1, math.ceil(keys * rate / self.target))

    def attention_took(self, path: str, seconds: float, keys: int) -> None:
        """A piece on `path` over `keys` keys took `seconds`: the rate follows it."""
        if keys <= 0:
            return
        rate, last = seconds / keys, self._key_seconds.get(path)
        self._key_seconds[path] = rate if last is None else last + ATTENTION_FOLLOW * (rate - last)
