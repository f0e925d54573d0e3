"""Token sampling from a step's logits, one row per sequence that samples.

The order is vLLM's: `allowed_token_ids` bans every other token, `logit_bias` is added,
`min_tokens` bans the stop tokens, the repetition, frequency and presence penalties are
applied, `bad_words` bans the token that would complete one, a grammar's mask
(structured output) removes what it forbids; then greedy rows are one batched
`argmax`, and the others apply temperature, min-p, top-k and top-p, all rows at once
with each row's own settings, and draw (`inverse_cdf`) with one number a row from the
request's own `torch.Generator`, so a seeded request gives the same tokens whatever
else shares its batch. Each processor works on the whole
`[rows, vocab]` tensor at once (index lists built from the rows that asked for it), and
a batch that asks for none of them costs one scan of its parameters.

Log-probabilities (`logprobs.py`) are of the model's own logits, before any of these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from kvscope.params import SamplingParams

from .logprobs import TokenLogprobs, logprobs_of, token_logprobs

#: `TokenLogprobs` and `token_logprobs` are reached through this module too.
__all__ = [
    "TOP_P_CANDIDATES",
    "Guide",
    "RowState",
    "Sampled",
    "TokenLogprobs",
    "logprobs_of",
    "make_generator",
    "process",
    "sample",
    "token_logprobs",
]


@attrs.frozen
class Sampled:
    """One chunk's output: its draw (`token` is None for a chunk that reaches no
    sequence's end) and, for a request that asked for `prompt_logprobs`, those of the
    prompt tokens its rows predict (`ChunkInput.prompt_targets`); for an `embed`
    request, its embedding instead of a token."""

    token: int | None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    #: For an `embed` request, at its prompt's end: its embedding, float32 values in
    #: the machine's byte order (and no token).
    embedding: bytes | None = None
    #: For a row that verified a draft: the draft tokens accepted, which come before
    #: `token` (speculative decoding, `kernels/speculative.py`).
    drafted: tuple[int, ...] = ()


class Guide(Protocol):
    """A grammar that constrains a request's tokens (`kvscope.kernels.guided`)."""

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        """A bool mask of the tokens allowed next, or None when all are."""
        ...

    def accept(self, token: int) -> None: ...

    @property
    def done(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


@attrs.define
class RowState:
    """What sampling needs from a request beyond its parameters, owned by the request.

    `tokens` is the sequence's own list (prompt then output); the event loop appends to
    it only between the steps that read it here.
    """

    tokens: list[int]
    num_prompt: int
    stop_ids: frozenset[int]
    guide: Guide | None = None
    #: The token sequences of its `bad_words` (`bad_word_ids`).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # `tokens` as a tensor, grown by the new tokens only (the worker's, for penalties).
    _tensor: torch.Tensor = attrs.field(
        init=False, factory=lambda: torch.empty(0, dtype=torch.long)
    )

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def token_tensor(self) -> torch.Tensor:
        known = self._tensor.numel()
        if known < len(self.tokens):
            new = torch.tensor(self.tokens[known:], dtype=torch.long)
            self._tensor = torch.cat([self._tensor, new]) if known else new
        return self._tensor


def make_generator(seed: int | None, fallback_seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else fallback_seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    states: Sequence[RowState | None] | None = None,
) -> list[Sampled]:
    """Pick one token per row of `logits` ([rows, vocab], float32)."""
    raw = logits
    states = states if states is not None else [None] * len(params)
    # Read once: a request that ends meanwhile drops its guide on the event loop.
    guides = [(i, s.guide) for i, s in enumerate(states) if s is not None and s.guide is not None]
    if guides or any(p.processed for p in params):
        logits = process(logits.float().clone(), params, states)
        for row, guide in guides:
            allowed = guide.allowed(logits.shape[-1])
            if allowed is not None:
                logits[row].masked_fill_(~allowed.to(logits.device), float("-inf"))
    # `max`'s indices are `argmax`'s (the first of equal maxima, NaN first, both
    # documented) at a third of the time on the CPU: 70 against 204 µs for 32 rows of
    # the reference model's 8,000 logits, 2 threads.
    tokens = logits.max(dim=-1).indices.tolist()
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if drawn:
        chosen = _draw(logits[drawn], [params[r] for r in drawn], [generators[r] for r in drawn])
        for row, token in zip(drawn, chosen, strict=True):
            tokens[row] = token
    for row, guide in guides:
        guide.accept(tokens[row])
    out = [Sampled(token) for token in tokens]
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        for row, lp in zip(wanted, logprobs_of(raw, tokens, params, wanted), strict=True):
            out[row] = Sampled(tokens[row], lp)
    return out


def process(
    logits: torch.Tensor, params: Sequence[SamplingParams], states: Sequence[RowState | None]
) -> torch.Tensor:
    """Apply `allowed_token_ids`, `logit_bias`, `min_tokens`, the penalties and
    `bad_words` to `logits` in place."""
    device = logits.device
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            banned = torch.ones(logits.shape[-1], dtype=torch.bool, device=device)
            banned[torch.tensor(p.allowed_token_ids, device=device)] = False
            logits[row].masked_fill_(banned, float("-inf"))
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(row)
            cols.append(token)
            values.append(bias)
    if rows:
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)
    rows, cols = [], []
    for row, (p, state) in enumerate(zip(params, states, strict=True)):
        if p.min_tokens and state is not None and state.num_output < p.min_tokens:
            rows.extend([row] * len(state.stop_ids))
            cols.extend(state.stop_ids)
    if rows:
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
    penalized = [
        i
        for i, (p, s) in enumerate(zip(params, states, strict=True))
        if s is not None
        and (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1)
    ]
    if penalized:
        _penalize(logits, penalized, params, states)
    rows, cols = [], []
    for row, state in enumerate(states):
        if state is not None and state.bad_words:
            completing = _completing(state.bad_words, state.tokens, state.num_output)
            rows.extend([row] * len(completing))
            cols.extend(completing)
    if rows:
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
    return logits


def _completing(
    sequences: tuple[tuple[int, ...], ...], tokens: list[int], num_output: int
) -> list[int]:
    """The tokens that would complete one of `sequences` after `tokens`, of which the
    last `num_output` are the output (vLLM's rule: a sequence begun in the prompt does
    not count)."""
    banned = []
    for sequence in sequences:
        head = len(sequence) - 1
        if head == 0 or (num_output >= head and tokens[-head:] == list(sequence[:head])):
            banned.append(sequence[-1])
    return banned


def _penalize(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    states: Sequence[RowState | None],
) -> None:
    """vLLM's penalties on these rows, in place: repetition over the prompt and output
    tokens, then frequency (times each output token's count) and presence (once per
    distinct output token). Sparse: the work is in the tokens seen, not the vocabulary.
    The token lists are built on the CPU and moved to the logits' device once."""
    vocab, device = logits.shape[-1], logits.device
    seen = [states[r].token_tensor() for r in rows]  # type: ignore[union-attr]
    out = [t[states[r].num_prompt :] for t, r in zip(seen, rows, strict=True)]  # type: ignore[union-attr]
    row_ids = torch.tensor(rows)

    def flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([t.numel() for t in tensors])
        flat_rows = torch.repeat_interleave(row_ids, lengths)
        return flat_rows.to(device), torch.cat(tensors).to(device)

    def per_row(name: str) -> torch.Tensor:
        values = torch.zeros(logits.shape[0])
        values[row_ids] = torch.tensor([getattr(params[r], name) for r in rows])
        return values.to(device)

    # A token seen twice is written twice with the same value (from the same original).
    r, c = flat(seen)
    values = logits[r, c]
    repetition = per_row("repetition_penalty")[r]
    logits[r, c] = torch.where(values > 0, values / repetition, values * repetition)
    out_rows, out_ids = flat(out)
    if out_ids.numel():
        # Per occurrence: the frequency penalty, and the presence penalty divided by the
        # token's count, so that each distinct token loses it exactly once.
        keys = out_rows * vocab + out_ids
        counts = torch.zeros(logits.numel(), device=device)
        counts.index_add_(0, keys, torch.ones(keys.numel(), device=device))
        per = (
            per_row("frequency_penalty")[out_rows]
            + per_row("presence_penalty")[out_rows] / counts[keys]
        )
        logits.view(-1).index_add_(0, keys, -per)


def _draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One draw a row from its `distribution`, by `inverse_cdf` with the row's
    generator."""
    probs, x = distribution(logits, params)
    # A row with a NaN (logits that overflowed, or none left) sums to NaN; softmax
    # gives no infinities. One sum a row, not a scan of a mask.
    finite = torch.isfinite(probs.sum(dim=-1)).tolist()
    uniforms = [uniform(g, logits.device) for g in generators]
    tokens = inverse_cdf(probs, torch.stack(uniforms))
    # Logits that overflowed: the most likely token.
    return [
        t if ok else int(x[row].argmax())
        for row, (t, ok) in enumerate(zip(tokens, finite, strict=True))
    ]


def uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) from `generator`, as every draw takes it."""
    return torch.rand((), dtype=torch.float64, generator=generator, device=device)


def distribution(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities to draw from, and the logits they are the softmax of:
    temperature, then min-p, top-k and top-p, each on every row at once with the rows'
    own settings (a row that does not ask is left as it is). Row by row this was ~8
    small ops a row: ~3 ms for the 32 rows of a reference-model decode step, a sixth of
    the step."""
    device = logits.device

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    x = logits.float() / column([p.temperature for p in params])
    vocab = x.shape[-1]
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(x, dim=-1)
        bar = column([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < bar, float("-inf"))
    if any(0 < p.top_k < vocab for p in params):
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        best = torch.topk(x, max(ks), dim=-1).values  # not a sort of the vocabulary
        kth = best.gather(1, torch.tensor(ks, device=device)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th stay
    if any(p.top_p < 1.0 for p in params):
        asks = torch.tensor([p.top_p < 1.0 for p in params], device=device)[:, None]
        x = _top_p(x, column([p.top_p for p in params]), asks)
    return torch.softmax(x, dim=-1), x


#: How many of a row's most likely tokens its top-p nucleus is looked for among first;
#: where they do not hold it (a flat distribution), among all. Sorting the whole
#: vocabulary cost 0.35 ms a row here, 11 ms for the 32 rows of a reference-model
#: decode step (the step itself ~18); a trained model's nucleus is mostly a few tokens.
TOP_P_CANDIDATES = 64


def _top_p(x: torch.Tensor, top_p: torch.Tensor, asks: torch.Tensor) -> torch.Tensor:
    """`x` with each asking row's tokens outside its nucleus at -inf: a token is dropped
    when the more likely tokens before it already hold more than `top_p` of the
    probability (the first always stays). Once a row's most likely tokens hold more
    than `top_p`, every token after them is out, so only those need ordering."""
    probs = torch.softmax(x, dim=-1)
    vocab = x.shape[-1]
    for k in dict.fromkeys((min(TOP_P_CANDIDATES, vocab), vocab)):
        values, tokens = torch.topk(probs, k, dim=-1)  # most likely first
        before = torch.cumsum(values, dim=-1) - values
        if k == vocab or bool(((before[:, -1:] + values[:, -1:] > top_p) | ~asks).all()):
            break
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(1, tokens, before <= top_p)
    return x.masked_fill(~(kept | ~asks), float("-inf"))


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """One draw a row of `probs` from one uniform number a row: the first token whose
    cumulative probability passes it. `torch.multinomial` draws an exponential number
    per token, which on the CPU took 130 us for 8,000 tokens (this: 8 us), a fifth of a
    32-row decode step of the reference model, and grows with the vocabulary. A token
    of probability 0 is never drawn: its cumulative sum equals the one before it."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    picks = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0].tolist()
    vocab = probs.shape[-1]
    return [
        pick if pick < vocab else int(probs[row].nonzero().max())  # u rounded up to the total
        for row, pick in enumerate(picks)
    ]
