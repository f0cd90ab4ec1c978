"""Forecast selection (fMoE's similarity rule) and distance arithmetic."""

from __future__ import annotations

import pytest
import torch

from moepager.predictors import Forecast, PredictorError, k_hot, target_of


@pytest.mark.parametrize("score, expected", [(0.9, [0, 1]), (0.3, [0, 1]), (0.05, [0, 1, 2, 3]), (-0.5, [0, 1, 2, 3])])
def test_similarity_rule_matches_the_papers_worked_example(score, expected):
    f = Forecast(torch.tensor([[0.5, 0.3, 0.1, 0.1]]), torch.tensor([score]))
    assert sorted(f.select(2)[0]) == expected


def test_without_confidence_the_top_k_are_selected_most_likely_first():
    f = Forecast(torch.tensor([[0.1, 0.6, 0.05, 0.25], [0.7, 0.1, 0.1, 0.1]]))
    assert f.select(2)[0] == [1, 3] and f.select(1) == [[1], [0]]
    assert f.sizes(9).tolist() == [4, 4]


def test_selection_needs_k_even_when_one_expert_carries_the_mass():
    f = Forecast(torch.tensor([[0.97, 0.01, 0.01, 0.01]]), torch.tensor([0.5]))
    assert len(f.select(3)[0]) == 3


def test_target_wraps_into_the_next_token():
    assert target_of(0, 1, 4) == (1, 0)
    assert target_of(3, 1, 4) == (0, 1)
    assert target_of(2, 4, 4) == (2, 1)
    with pytest.raises(PredictorError, match="1..4"):
        target_of(0, 5, 4)


def test_k_hot_ignores_missing_entries():
    probs = k_hot(torch.tensor([[1, 3], [2, -1]]), 4)
    assert probs.tolist() == [[0, 0.5, 0, 0.5], [0, 0, 1, 0]]


@pytest.mark.parametrize("confidence", [None, torch.tensor([0.9, 0.05])])
def test_chosen_pairs_the_selected_experts_with_their_probabilities(confidence):
    f = Forecast(torch.tensor([[0.1, 0.6, 0.05, 0.25], [0.4, 0.3, 0.2, 0.1]]), confidence)
    chosen = f.chosen(2)
    assert [[e for e, _ in row] for row in chosen] == f.select(2)
    assert all(p == pytest.approx(float(f.probs_NE[n, e])) for n, row in enumerate(chosen) for e, p in row)
    assert [len(row) for row in chosen] == ([2, 2] if confidence is None else [2, 4])
