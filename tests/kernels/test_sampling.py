"""Sampling: logit bias, min_tokens, penalties and log-probabilities, against hand
computations on small logits; and the bounds `SamplingParams` puts on them."""

from __future__ import annotations

import math

import pytest
import torch

from kvscope.errors import InvalidRequest
from kvscope.kernels.sampling import TOP_P_CANDIDATES, RowState, sample
from kvscope.params import SamplingParams

GREEDY = {"temperature": 0.0, "max_tokens": 8}


def field_of(exc: BaseException) -> str | None:
    """The field a refusal is about: its `field`, which its message starts with."""
    assert isinstance(exc, InvalidRequest), repr(exc)
    assert str(exc).split(" ", 1)[0] == exc.field, (str(exc), exc.field)
    return exc.field


#: Seeded draws per distribution test: five standard deviations of a share are ~1.8 %.
DRAWS = 20_000


def draw_counts(logits: torch.Tensor, params: SamplingParams, *, seed: int) -> list[int]:
    """How often each token of `logits`' one row is drawn in `DRAWS` seeded draws."""
    generator = torch.Generator().manual_seed(seed)
    counts = [0] * logits.shape[-1]
    for _ in range(DRAWS):
        counts[sample(logits, [params], [generator])[0].token] += 1
    return counts


def row_state(tokens: list[int], num_prompt: int, stop_ids: tuple[int, ...] = (9,)) -> RowState:
    return RowState(list(tokens), num_prompt, frozenset(stop_ids))


def test_plain_greedy_rows_are_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]])
    out = sample(logits, [SamplingParams(**GREEDY)] * 2, [None, None])
    assert [s.token for s in out] == [1, 0] and all(s.logprobs is None for s in out)


def test_greedy_rows_take_argmaxs_token_on_ties_nans_and_masked_rows() -> None:
    """The first of equal maxima, the first NaN, and token 0 for a row with every
    token banned, as `torch.argmax` gives them, on rows as wide as a real vocabulary."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 8000), generator=generator).float()  # many ties
    logits[5, [17, 4000]] = float("nan")
    logits[9] = float("-inf")
    out = sample(logits, [SamplingParams(**GREEDY)] * 64, [None] * 64)
    assert [s.token for s in out] == logits.argmax(dim=-1).tolist()
    assert out[5].token == 17 and out[9].token == 0


def test_logprobs_are_the_raw_log_softmax_and_its_top_k() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5], [0.0, 0.0, 0.0, 3.0]])
    # Row 0 is biased towards token 2 and samples it; its log-probabilities stay those
    # of the model's own logits (vLLM's default, raw_logprobs).
    params = [
        SamplingParams(**GREEDY, logprobs=2, logit_bias={2: 100}),
        SamplingParams(**GREEDY, logprobs=0),
    ]
    out = sample(logits, params, [None, None])
    assert [s.token for s in out] == [2, 3]
    expected = torch.log_softmax(logits, dim=-1)
    first = out[0].logprobs
    assert first is not None and math.isclose(first.logprob, float(expected[0, 2]), rel_tol=1e-6)
    assert [t for t, _ in first.top] == [1, 3]
    assert [lp for _, lp in first.top] == pytest.approx(expected[0, [1, 3]].tolist())
    assert first.rank == 4  # token 2 is the least likely of the four: three above it
    second = out[1].logprobs
    assert second is not None and second.top == () and second.rank == 1
    assert math.isclose(second.logprob, float(expected[1, 3]), rel_tol=1e-6)


def test_logprob_token_ids_take_the_place_of_the_top_k() -> None:
    """vLLM's `logprob_token_ids`: each row's alternatives are the named tokens, in
    their order, whatever their rank; a row without them keeps its top k."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5], [0.0, 0.0, 0.0, 3.0]])
    params = [
        SamplingParams(**GREEDY, logprobs=3, logprob_token_ids=[2, 0]),
        SamplingParams(**GREEDY, logprobs=1),
    ]
    out = sample(logits, params, [None, None])
    expected = torch.log_softmax(logits, dim=-1)
    first, second = out[0].logprobs, out[1].logprobs
    assert first is not None and second is not None
    assert [t for t, _ in first.top] == [2, 0]
    assert [lp for _, lp in first.top] == pytest.approx(expected[0, [2, 0]].tolist())
    assert math.isclose(first.logprob, float(expected[0, 1]), rel_tol=1e-6)
    assert [t for t, _ in second.top] == [3]
    with pytest.raises(ValueError, match="logprob_token_ids needs logprobs"):
        SamplingParams(logprob_token_ids=[1])
    with pytest.raises(ValueError, match="logprob_token_ids may name at most 128"):
        SamplingParams(logprobs=0, logprob_token_ids=list(range(129)))
    with pytest.raises(ValueError, match=r"logprob_token_ids holds token_id\(s\) \[4\]"):
        SamplingParams(logprobs=0, logprob_token_ids=[1, 4]).check_vocab(4)


def test_logprobs_are_held_to_the_engines_cap() -> None:
    """vLLM's `--max-logprobs` (20 unless told): -1 is the whole vocabulary, and a cap
    of -1 holds nothing back; the kernel gives every token where -1 asks."""
    for fields in ({"logprobs": 21}, {"logprobs": -1}, {"prompt_logprobs": -1}):
        with pytest.raises(ValueError, match="greater than max allowed: 20") as caught:
            SamplingParams(**fields).check_vocab(100)
        assert field_of(caught.value) == next(iter(fields))
    SamplingParams(logprobs=-1, prompt_logprobs=100).check_vocab(100, max_logprobs=100)
    SamplingParams(logprobs=5000).check_vocab(100, max_logprobs=-1)
    out = sample(torch.tensor([[0.5, 2.0, -1.0]]), [SamplingParams(**GREEDY, logprobs=-1)], [None])
    assert out[0].logprobs is not None and [t for t, _ in out[0].logprobs.top] == [1, 0, 2]


def test_logit_bias_bans_and_forces() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.0]])
    banned = sample(logits, [SamplingParams(**GREEDY, logit_bias={"1": -100})], [None])
    forced = sample(logits, [SamplingParams(**GREEDY, logit_bias={3: 100.0})], [None])
    assert banned[0].token == 2 and forced[0].token == 3


def test_allowed_token_ids_keep_only_theirs() -> None:
    """Greedy picks the best allowed token; a draw never leaves the allowed set; their
    log-probabilities stay the model's raw ones; an empty set or a negative id is
    refused by name."""
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.0]])
    greedy = sample(
        logits, [SamplingParams(**GREEDY, allowed_token_ids=[0, 2], logprobs=0)], [None]
    )
    assert greedy[0].token == 2
    raw = torch.log_softmax(logits[0], dim=-1)[2].item()
    assert greedy[0].logprobs is not None and greedy[0].logprobs.logprob == pytest.approx(raw)
    hot = [SamplingParams(temperature=5.0, max_tokens=8, allowed_token_ids=[0, 3])]
    generator = torch.Generator().manual_seed(2)
    assert {sample(logits, hot, [generator])[0].token for _ in range(400)} == {0, 3}
    for bad in ([], [-1]):
        with pytest.raises(ValueError) as caught:
            SamplingParams(allowed_token_ids=bad)
        assert field_of(caught.value) == "allowed_token_ids"
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[4]).check_vocab(4)


def test_min_tokens_bans_the_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]])
    params = SamplingParams(**GREEDY, min_tokens=2)
    early = sample(logits, [params], [None], [row_state([4, 5, 1], num_prompt=2)])
    late = sample(logits, [params], [None], [row_state([4, 5, 1, 1], num_prompt=2)])
    assert early[0].token == 1 and late[0].token == 9


def test_penalties_as_computed_by_hand() -> None:
    logits = torch.tensor([[2.0, 1.9, -0.5, 1.0, 1.2]])
    prompt, output = [3], [0, 0, 2]
    p = SamplingParams(
        **GREEDY, repetition_penalty=1.5, frequency_penalty=0.2, presence_penalty=0.3
    )
    state = row_state(prompt + output, num_prompt=1)
    # By hand: repetition over prompt and output tokens (0, 2, 3), then frequency x count
    # and presence once, over output tokens only (0 twice, 2 once).
    expected = [
        2.0 / 1.5 - 0.2 * 2 - 0.3,
        1.9,
        -0.5 * 1.5 - 0.2 - 0.3,
        1.0 / 1.5,
        1.2,
    ]
    from kvscope.kernels.sampling import process

    processed = process(logits.clone(), [p], [state])
    assert processed[0].tolist() == pytest.approx(expected)
    assert sample(logits, [p], [None], [state])[0].token == 1
    assert sample(logits, [SamplingParams(**GREEDY)], [None])[0].token == 0


def test_a_batch_mixes_plain_and_processed_rows() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    params = [
        SamplingParams(**GREEDY),
        SamplingParams(**GREEDY, presence_penalty=2.0),
        SamplingParams(**GREEDY, logit_bias={2: 10}),
    ]
    states = [None, row_state([1, 0], num_prompt=1), None]
    assert [s.token for s in sample(logits, params, [None] * 3, states)] == [0, 1, 2]
    assert logits[0].tolist() == [2.0, 1.0, 0.0]  # the step's logits are left alone


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": "a lot"}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logprobs": 2**31}, "logprobs"),
        ({"logprobs": -2}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
    ],
)
def test_out_of_range_values_name_their_field(fields: dict, field: str) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**fields)
    assert field_of(caught.value) == field


def test_any_64_bit_seed_and_logit_bias_keys_as_json_gives_them() -> None:
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(logit_bias={"7": -100, 3: 1.5}).logit_bias == ((3, 1.5), (7, -100.0))
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingParams(logit_bias={300: 1}).check_vocab(258)


def test_a_guide_masks_its_row_before_sampling_and_follows_the_draw() -> None:
    from kvscope.kernels.guided import GuideCompiler
    from kvscope.models.tokenizer import ByteTokenizer

    compiler = GuideCompiler(ByteTokenizer(), 258)
    params = SamplingParams(**GREEDY, guided_regex="[xy]z")
    guide = compiler.guide(params)
    state = RowState([256], 1, frozenset({257}), guide)
    logits = torch.zeros(2, 258)
    logits[:, ord("a")] = 10.0  # what the model wants, and the grammar forbids
    drawn = []
    for _ in range(2):
        out = sample(logits, [params, SamplingParams(**GREEDY)], [None, None], [state, None])
        drawn.append(out[0].token)
        assert out[1].token == ord("a")  # the other row is untouched
    assert bytes(drawn) in (b"xz", b"yz") and guide is not None and guide.done


def test_temperature_draws_follow_the_softmax_and_never_pick_a_banned_token() -> None:
    """20,000 seeded draws from softmax([log 0.5, log 0.3, log 0.2, -inf]) land within
    five standard deviations of each probability, and the banned token never comes."""
    probs = [0.5, 0.3, 0.2, 0.0]
    logits = torch.tensor([[math.log(p) if p else float("-inf") for p in probs]])
    counts = draw_counts(logits, SamplingParams(temperature=1.0, max_tokens=8), seed=7)
    assert counts[3] == 0
    for p, count in zip(probs[:3], counts[:3], strict=True):
        assert abs(count / DRAWS - p) < 5 * math.sqrt(p * (1 - p) / DRAWS)


def test_a_seeded_draw_repeats_and_top_k_keeps_only_the_k_most_likely() -> None:
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=2.0, top_k=3, max_tokens=8)]
    top3 = set(logits[0].topk(3).indices.tolist())

    def run(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample(logits, params, [generator])[0].token for _ in range(300)]

    first = run(11)
    assert first == run(11)
    assert set(first) == top3  # all three drawn, nothing else


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_best() -> None:
    """softmax([log .5, log .3, log .15, log .05]) with min_p 0.25: the bar is 0.125,
    so the last token is never drawn and the others keep their renormalized shares;
    at temperature 2 the bar applies to the flattened probabilities (vLLM's order)."""
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([[math.log(p) for p in probs]])
    generator = torch.Generator().manual_seed(3)
    counts = draw_counts(logits, SamplingParams(temperature=1.0, min_p=0.25, max_tokens=8), seed=3)
    assert counts[3] == 0
    for p, count in zip(probs[:3], counts[:3], strict=True):
        share = p / 0.95
        assert abs(count / DRAWS - share) < 5 * math.sqrt(share * (1 - share) / DRAWS)
    # Temperature 2 flattens to ~[.38, .30, .21, .12]: 0.12 clears 0.25 * 0.38 = 0.095.
    hot = [SamplingParams(temperature=2.0, min_p=0.25, max_tokens=8)]
    tokens = {sample(logits, hot, [generator])[0].token for _ in range(2_000)}
    assert tokens == {0, 1, 2, 3}
    with pytest.raises(ValueError) as caught:
        SamplingParams(min_p=1.5)
    assert field_of(caught.value) == "min_p"


def test_bad_words_ban_the_token_that_would_complete_one() -> None:
    """A one-token word is never drawn; a longer one's last token only right after the
    rest of it in the output (vLLM's rule: a start in the prompt does not count)."""
    logits = torch.tensor([[0.0, 1.0, 0.0, 5.0, 4.0]])
    params = [SamplingParams(**GREEDY, bad_words=["w"])]

    def drawn(tokens: list[int], num_prompt: int, words: tuple[tuple[int, ...], ...]) -> int | None:
        state = RowState(tokens, num_prompt, frozenset(), bad_words=words)
        return sample(logits, params, [None], [state])[0].token

    assert drawn([1, 2], 1, ((3,),)) == 4  # a one-token word: always banned
    assert drawn([1, 2], 1, ((2, 3),)) == 4  # 2 then 3 is the word: 3 is banned
    assert drawn([1, 2], 1, ((1, 3),)) == 3  # 1 is not the last output token
    assert drawn([2], 1, ((2, 3),)) == 3  # its start is in the prompt
    assert drawn([1, 2, 4], 1, ((2, 4, 3), (4,))) == 1  # both complete here
    with pytest.raises(ValueError) as caught:
        SamplingParams(bad_words=[""])
    assert field_of(caught.value) == "bad_words"


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch() -> None:
    """Rows of other temperatures, min-p, top-k and top-p settings, and greedy ones,
    drawn together: each seeded row gives the tokens it gives drawn alone, and keeps
    to its own top-k."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(5))
    settings = [
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, top_p=0.6),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.0),
        dict(temperature=1.5, top_k=40, top_p=0.9, min_p=0.01),
    ]
    params = [SamplingParams(max_tokens=8, **s) for s in settings]

    def seeded() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(100 + i) for i in range(len(params))]

    together, alone = seeded(), seeded()
    for _ in range(50):
        batch = [s.token for s in sample(logits, params, together)]
        singles = [
            sample(logits[i : i + 1], [params[i]], [alone[i]])[0].token for i in range(len(params))
        ]
        assert batch == singles
        assert batch[0] in set(logits[0].topk(5).indices.tolist())
        assert batch[3] == int(logits[3].argmax())


def test_top_p_keeps_the_nucleus_even_past_the_first_candidates() -> None:
    """softmax([log .5, log .3, log .15, log .05]) with top_p 0.7: the first two tokens
    hold it, so only they are drawn, at their renormalized shares. A nearly flat row of
    1,000 tokens has a nucleus of hundreds: every draw is in it (the reference: sort
    the whole row), and draws reach past the first candidates looked at."""
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([[math.log(p) for p in probs]])
    counts = draw_counts(logits, SamplingParams(temperature=1.0, top_p=0.7, max_tokens=8), seed=4)
    assert counts[2] == counts[3] == 0
    for p, count in zip(probs[:2], counts[:2], strict=True):
        share = p / 0.8
        assert abs(count / DRAWS - share) < 5 * math.sqrt(share * (1 - share) / DRAWS)
    flat = -torch.arange(1000, dtype=torch.float32)[None] * 1e-3
    ordered = torch.softmax(flat[0], dim=-1)  # already most likely first
    nucleus = int(((torch.cumsum(ordered, dim=-1) - ordered) <= 0.5).sum())
    params = [SamplingParams(temperature=1.0, top_p=0.5, max_tokens=8)]
    generator = torch.Generator().manual_seed(5)
    drawn = {sample(flat, params, [generator])[0].token for _ in range(3_000)}
    assert max(drawn) < nucleus and max(drawn) > 4 * TOP_P_CANDIDATES  # past the first look
