from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from moepager.errors import InvalidRequestError
from moepager.runtime.sampling import (
    NonFiniteLogits,
    RequestSampler,
    SamplingParams,
    filtered_probs,
    penalised,
    sample_rows,
)


@dataclass
class Row:
    sampler: RequestSampler
    prompt_ids: list[int] = field(default_factory=list)
    out_ids: list[int] = field(default_factory=list)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-0.5), dict(temperature=float("nan")),
                                    dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(stop=("",))])
def test_invalid_values_are_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert (p[0, 2:] == 0).all() and p[0, :2].sum() == pytest.approx(1.0)
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert p[0, 0] == 1.0


def test_seeded_sampling_is_reproducible_and_rows_independent():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(rows: list[int]) -> list[int]:
        picked = sample_rows(logits[rows], [Row(RequestSampler(params, r)) for r in rows])
        return [token for token, _ in picked]
    a = [draw([0, 1, 2]) for _ in range(2)]
    assert a[0] == a[1]
    # Row 2 alone draws what it drew inside the batch: each request has its own generator.
    assert draw([2]) == [a[0][2]]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    rows = [Row(RequestSampler(SamplingParams())) for _ in range(2)]
    assert sample_rows(logits, rows) == [(1, None), (0, None)]
    ties = torch.randint(0, 3, (4, 5000), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = [Row(RequestSampler(SamplingParams())) for _ in range(4)]
    assert [t for t, _ in sample_rows(ties, rows)] == ties.float().argmax(-1).tolist()  # the first of equal maxima


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_row_with_nan_or_either_infinity_is_reported_in_its_place_and_the_others_sampled(bad):
    logits = torch.zeros(3, 8)
    logits[1, 5] = bad
    logits[2, 3] = 1.0
    got = sample_rows(logits, [Row(RequestSampler(SamplingParams(temperature=t, seed=0))) for t in (0.0, 0.0, 0.7)])
    assert isinstance(got[1], NonFiniteLogits) and got[1].rows == [1]
    assert got[0] == (0, None) and isinstance(got[2], tuple) and 0 <= got[2][0] < 8


@pytest.mark.parametrize("kwargs", [dict(min_p=1.5), dict(repetition_penalty=0.0), dict(presence_penalty=2.5),
                                    dict(frequency_penalty=-3.0), dict(logprobs=-1), dict(logprobs=21)])
def test_invalid_penalties_and_logprobs_are_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_min_p_drops_tokens_below_a_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.35))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    rep = penalised(logits, [0], [1], SamplingParams(repetition_penalty=2.0))
    torch.testing.assert_close(rep, torch.tensor([1.0, -2.0, 0.5, 3.0]))  # positive divided, negative multiplied
    pf = penalised(logits, [0], [3, 3, 2], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    torch.testing.assert_close(pf, torch.tensor([2.0, -1.0, 0.5 - 0.75, 3.0 - 1.0]))  # only generated tokens count


def test_a_repetition_penalty_changes_a_greedy_choice_and_logprobs_report_the_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    sampler = RequestSampler(SamplingParams(repetition_penalty=1.5, logprobs=2))
    [(token, logprobs)] = sample_rows(logits, [Row(sampler, [0])])
    assert token == 1 and logprobs is not None and logprobs.token == 1
    assert set(logprobs) == {0, 1} and logprobs[1] > logprobs[0]
    assert sum(torch.tensor(list(logprobs.values())).exp()) < 1


EDGES = [0.0, 1e-300, 1e-45, 1e-40, 1e-38, 1e-8, 0.5, 1.0, 2.0, 1e8, 1e38, 1e300, float("inf"), float("-inf"),
         float("nan"), -1e-300, -1.0, -2.0, -3.0]
"""Values at every edge a float parameter has: zero, tiny (subnormal in fp32, or 0 there), huge (infinite in fp32),
the infinities, NaN, negatives."""


def _settings():
    from hypothesis import strategies as st

    value = st.one_of(st.sampled_from(EDGES), st.floats(allow_nan=True, allow_infinity=True))
    return st.fixed_dictionaries({
        "temperature": value, "top_p": value, "min_p": value, "repetition_penalty": value,
        "presence_penalty": value, "frequency_penalty": value,
        "top_k": st.one_of(st.sampled_from([0, 1, 2, 49, 50, 51, 10**12, -1]), st.integers()),
        "logprobs": st.one_of(st.none(), st.integers(-1, 21)),
    }), st.lists(st.sampled_from([-1e30, -3.0, 0.0, 0.0, 1e-30, 2.5, 3.0, 88.0, 1e30]), min_size=50, max_size=50)


def test_every_sampling_setting_gives_a_valid_token_or_a_clear_refusal():
    """10,000 generated settings of temperature, top-p, top-k, min-p and the three penalties at their edges, on
    logits with ties and huge values, a prompt and an output to penalise: each either is refused up front
    (InvalidRequestError) or samples a token of the vocabulary, with finite log-probabilities; never NaN, never
    another exception."""
    from hypothesis import HealthCheck, given, settings

    params_st, logits_st = _settings()

    @settings(max_examples=10_000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(params_st, logits_st)
    def check(kwargs, values):
        try:
            params = SamplingParams(seed=0, **kwargs)
        except InvalidRequestError:
            return
        logits = torch.tensor([values], dtype=torch.float32)
        [(token, logprobs)] = sample_rows(logits, [Row(RequestSampler(params), [3, 7, 7], [7, 9])])
        assert 0 <= token < 50
        if logprobs is not None:
            assert all(v == v and v <= 0 for v in logprobs.values())  # no NaN

    check()


def test_a_temperature_fp32_cannot_divide_by_acts_as_greedy_and_a_tiny_one_samples_the_best():
    logits = torch.tensor([[1.0, 5.0, 4.999]])
    for t in (1e-300, 1e-45, 1e-40, 1e-20):
        [(token, _)] = sample_rows(logits, [Row(RequestSampler(SamplingParams(temperature=t, seed=1)))])
        assert token == 1, t
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-20).greedy


def test_extreme_repetition_penalties_keep_the_logits_finite():
    logits = torch.tensor([2.0, 0.0, -1.0, 1.0])
    for penalty in (1e-300, 1e300):
        out = penalised(logits, [0, 1, 2], [], SamplingParams(repetition_penalty=penalty))
        assert torch.isfinite(out).all() and out[1] == 0 and out[3] == 1.0
        assert (out[0] > out[3]) == (penalty < 1) and out[2] < -1.0 if penalty > 1 else out[2] > -1.0
