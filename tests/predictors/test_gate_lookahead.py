"""Gate lookahead applies the target layer's router to the latest router input."""

from __future__ import annotations

import pytest
import torch

from moepager.predictors import LayerObservation, PredictorError, make_predictor


def test_forecast_is_the_target_routers_distribution_of_the_latest_input():
    w = [torch.randn(4, 3), torch.randn(4, 3)]
    routers = [lambda x, w=w_: torch.softmax(x @ w.T, -1) for w_ in w]
    p = make_predictor("gate-lookahead", num_layers=2, num_experts=4, routers=routers)
    x = torch.randn(5, 3)
    p.start_iteration(torch.arange(5), None)
    assert p.forecast(1, 0) is None
    p.observe(0, LayerObservation(torch.full((5, 4), 0.25), torch.zeros(5, 1, dtype=torch.long), x))
    torch.testing.assert_close(p.forecast(1, 0).probs_NE, torch.softmax(x @ w[1].T, -1))
    torch.testing.assert_close(p.forecast(0, 1).probs_NE, torch.softmax(x @ w[0].T, -1))


def test_needs_the_models_routers():
    with pytest.raises(PredictorError, match="routers"):
        make_predictor("gate-lookahead", num_layers=2, num_experts=4)
