"""A step's prefill tokens, bounded by time as well as by the token budget.

A step's forward time grows with the tokens it carries; a long prefill chunk makes a
long step, and so a long wait for every other request's next token (and, without the
forward's linear slicing, for a cancel's next checkpoint). `StepTimeBudget` learns
`seconds = fixed + per_token * tokens` from the steps' own forward times (a least
squares fit that forgets old steps geometrically, so it follows the machine's load and
thread count) and answers how many prefill tokens still fit in `max_seconds` beside the
step's decode rows.

It is fed by the step actor after each step (`observe`); until it has seen steps of
two different sizes it bounds nothing, and it never bounds a step below `floor`
prefill tokens, so prefill always progresses.
"""

from __future__ import annotations

import math

#: Weight a step's observation keeps after each later one (about the last 20 steps count).
MEMORY = 0.95


class StepTimeBudget:
    def __init__(self, max_seconds: float, *, floor: int = 16) -> None:
        self.max_seconds = max_seconds  # 0: no bound by time
        self.floor = floor
        # Geometrically weighted sums of 1, tokens, seconds, tokens^2, tokens*seconds.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        """(step actor) A step of `tokens` tokens (decode and prefill) took `seconds`."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        m = MEMORY
        self._w = m * self._w + 1.0
        self._x = m * self._x + tokens
        self._y = m * self._y + seconds
        self._xx = m * self._xx + tokens * tokens
        self._xy = m * self._xy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), once steps of different sizes were seen."""
        spread = self._w * self._xx - self._x * self._x
        if spread <= 1e-9 * self._xx * self._w:  # one size seen: no slope
            return None
        per_token = (self._w * self._xy - self._x * self._y) / spread
        if per_token <= 0:
            return None
        return max(0.0, (self._y - per_token * self._x) / self._w), per_token

    def prefill_tokens(self, decode_tokens: int, cap: int) -> int:
        """How many prefill tokens a step with `decode_tokens` decode rows may carry
        (at most `cap`, at least `floor`)."""
        fit = self.fit() if self.max_seconds > 0 else None
        if fit is None:
            return cap
        fixed, per_token = fit
        room = (self.max_seconds - fixed) / per_token - decode_tokens
        return max(min(self.floor, cap), min(cap, math.floor(room + 1e-6)))
