from __future__ import annotations

import pytest
import torch

from moepager.errors import InvalidRequestError
from moepager.runtime.sampling import Sampler, SamplingParams, filtered_probs


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
    a = [Sampler(params, 3)(logits, [0, 1, 2]) for _ in range(2)]
    assert a[0] == a[1]
    # Row 2 alone draws what it drew inside the batch: each request has its own generator.
    assert Sampler(params, 3)(logits[2:], [2]) == [a[0][2]]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert Sampler(SamplingParams(), 2)(logits, [0, 1]) == [1, 0]
