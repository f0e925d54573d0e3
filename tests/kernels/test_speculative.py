"""Verifying drafts (`kernels/speculative.py`): greedy rows take the draft's prefix that
matches the argmaxes; sampled rows keep the model's distribution exactly, checked by a
chi-square test on many seeded draws, and draw what `sample` draws from the same
generator, a token at a time."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvscope.kernels.sampling import distribution, sample
from kvscope.kernels.speculative import verify_greedy, verify_sampled
from kvscope.params import SamplingParams

#: The 0.999 quantile of the chi-square distribution with 4 degrees of freedom (five
#: outcomes): a right rule passes below it but for 1 seed in 1,000.
CHI_SQUARE_4_AT_999 = 18.467
DRAWS = 8_000


def _logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize(
    ("draft", "accepted", "token"),
    [([2, 0], [2, 0], 1), ([2, 1], [2], 0), ([4, 0], [], 2), ([], [], 2)],
)
def test_greedy_takes_the_prefix_the_argmaxes_match(
    draft: list[int], accepted: list[int], token: int
) -> None:
    rows = [[0.0, 1.0, 5.0, 5.0, 0.0], [3.0, 1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 1.0, 0.0]]
    assert verify_greedy(_logits(*rows[: len(draft) + 1]), draft) == (accepted, token)


def _chi_square(counts: Counter[int], probs: torch.Tensor) -> float:
    """Pearson's statistic of `counts` against `probs`; a token of probability 0 must
    never be drawn (and counts for nothing)."""
    total = sum(counts.values())
    assert all(float(probs[token]) > 0 for token in counts), (counts, probs)
    return sum(
        (counts.get(token, 0) - total * float(p)) ** 2 / (total * float(p))
        for token, p in enumerate(probs)
        if p > 0
    )


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)],
    ids=["plain", "top-p"],
)
def test_sampled_rows_keep_the_models_distribution(params: SamplingParams) -> None:
    logits = _logits([0.5, 1.2, 0.0, 0.9, 0.3], [1.0, 0.2, 0.6, 0.0, 0.4], [0.0] * 5)
    draft = [1, 2]
    generator = torch.Generator().manual_seed(11)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()  # after the first draft token was taken
    for _ in range(DRAWS):
        accepted, token = verify_sampled(logits, draft, params, generator)
        made = [*accepted, token]
        first[made[0]] += 1
        if accepted[:1] == draft[:1]:
            second[made[1]] += 1
    expected_first, expected_second = distribution(logits[:2], [params] * 2)[0]
    assert _chi_square(first, expected_first) < CHI_SQUARE_4_AT_999
    assert sum(second.values()) > DRAWS * 0.2  # the first draft token is often taken
    assert _chi_square(second, expected_second) < CHI_SQUARE_4_AT_999


def test_a_seeded_row_draws_the_same_each_time() -> None:
    logits = _logits([0.5, 1.2, 0.0, 0.9, 0.3], [1.0, 0.2, 0.6, 0.0, 0.4], [0.0] * 5)
    params = SamplingParams(temperature=1.0)
    runs = [
        [verify_sampled(logits, [1, 2], params, generator) for _ in range(50)]
        for generator in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))
    ]
    assert runs[0] == runs[1]


def test_a_sampled_row_draws_as_sample_does_a_token_at_a_time() -> None:
    logits = _logits([0.5, 1.2, 0.0, 0.9, 0.3], [1.0, 0.2, 0.6, 0.0, 0.4], [0.0] * 5)
    params = SamplingParams(temperature=0.9, top_k=4)
    for seed in range(40):
        accepted, token = verify_sampled(
            logits, [1, 2], params, torch.Generator().manual_seed(seed)
        )
        plain = torch.Generator().manual_seed(seed)
        made = [sample(logits[i : i + 1], [params], [plain])[0].token for i in range(3)]
        assert [*accepted, token] == made[: len(accepted) + 1]
