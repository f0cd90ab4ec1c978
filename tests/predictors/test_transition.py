"""Transition tables: counted from hand-made routing, saved and loaded, forecasts from the freshest layer."""

from __future__ import annotations

import pytest
import torch

from moepager.predictors import LayerObservation, PredictorError, TransitionPredictor, k_hot, make_predictor

E = 6


def cyclic(tokens: int, layers: int) -> torch.Tensor:
    """Expert (t + l) % E at layer l of token t, top-1: layer l+1 of a token follows layer l deterministically."""
    return torch.tensor([[[(t + layer) % E] for layer in range(layers)] for t in range(tokens)])


def observe(p, ids_TLK: torch.Tensor, upto: int) -> None:
    p.start_iteration(torch.arange(len(ids_TLK)), None)
    for layer in range(upto + 1):
        p.observe(layer, LayerObservation(k_hot(ids_TLK[:, layer], E), ids_TLK[:, layer]))


def test_deterministic_routing_is_forecast_exactly_at_every_distance():
    ids = cyclic(40, 3)
    p = TransitionPredictor.fit(ids, torch.zeros(40, dtype=torch.long), E, distances=[1, 2, 3])
    assert p.distances == {1, 2, 3}
    observe(p, ids, 0)
    assert (p.forecast(1, 0).top(1)[:, 0] == ids[:, 1, 0]).all()
    assert (p.forecast(2, 0).top(1)[:, 0] == ids[:, 2, 0]).all()
    assert (p.forecast(0, 1).top(1)[:-1, 0] == ids[1:, 0, 0]).all()  # distance 3 = the next token's layer 0


def test_transitions_do_not_cross_request_boundaries():
    ids = torch.tensor([[[0], [1]], [[5], [5]], [[0], [1]]])
    requests = torch.tensor([0, 1, 1])
    p = TransitionPredictor.fit(ids, requests, E, distances=[2])
    table = p.tables[(0, 0, 1)]  # layer 0 -> next token's layer 0
    assert table[0].argmax() != 5 or table[0, 5] == table[0].min()  # 0 -> 5 crosses requests: not counted
    assert table[5].argmax() == 0


def test_saved_tables_load_through_the_registry(tmp_path):
    p = TransitionPredictor.fit(cyclic(20, 3), torch.zeros(20, dtype=torch.long), E, distances=[1])
    p.save(tmp_path / "t.pt")
    loaded = make_predictor("transition", num_layers=3, num_experts=E, file=tmp_path / "t.pt", distance=1)
    assert all(torch.equal(loaded.tables[k], p.tables[k]) for k in p.tables)
    with pytest.raises(PredictorError, match="distances \\[1\\], not 2"):
        make_predictor("transition", num_layers=3, num_experts=E, file=tmp_path / "t.pt", distance=2)
    with pytest.raises(PredictorError, match="3 MoE layers x 6 experts; this model has 4 x 6"):
        make_predictor("transition", num_layers=4, num_experts=E, file=tmp_path / "t.pt", distance=1)
    with pytest.raises(PredictorError, match="holds a 'transition' predictor, not 'token-wise'"):
        make_predictor("token-wise", num_layers=3, num_experts=E, file=tmp_path / "t.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(PredictorError, match="not a moepager predictor file"):
        make_predictor("transition", num_layers=3, num_experts=E, file=tmp_path / "bad.pt", distance=1)
    with pytest.raises(PredictorError, match="unknown predictor 'oracle'"):
        make_predictor("oracle", num_layers=3, num_experts=E)


def test_rare_sources_back_off_to_the_target_layers_frequencies():
    # expert 0 at layer 0 is seen once, followed by expert 1; everything else goes 2 -> 3
    ids = torch.tensor([[[0], [1]]] + [[[2], [3]]] * 50)
    p = TransitionPredictor.fit(ids, torch.arange(51), E, distances=[1])
    probs = p.backed_off((0, 1, 0))
    assert probs[2].argmax() == 3 and probs[2, 3] > 0.8  # a frequent source speaks for itself
    assert probs[0].argmax() == 3  # one sighting of 0 -> 1 is outweighed by the target's frequencies (alpha 8)
    assert torch.allclose(probs.sum(1), torch.ones(E))


def test_several_sources_combine_the_older_layers_tables():
    # layer 2 copies layer 0 and ignores layer 1 (random): one source (layer 1) cannot tell, two can
    g = torch.Generator().manual_seed(0)
    first = torch.randint(0, E, (400,), generator=g)
    ids = torch.stack([first, torch.randint(0, E, (400,), generator=g), first], 1)[:, :, None]
    one = TransitionPredictor.fit(ids, torch.arange(400), E, distances=[1, 2])
    two = TransitionPredictor.fit(ids, torch.arange(400), E, distances=[1, 2])
    two.sources = 2
    for p in (one, two):
        observe(p, ids, 1)
    right = [(p.forecast(2, 0).top(1)[:, 0] == first).float().mean().item() for p in (one, two)]
    assert right[0] < 0.4 and right[1] > 0.95


def test_old_smoothed_tables_are_refused_with_the_fix(tmp_path):
    torch.save({"kind": "transition", "num_layers": 3, "num_experts": E, "tables": {}}, tmp_path / "old.pt")
    with pytest.raises(PredictorError, match="refit it"):
        make_predictor("transition", num_layers=3, num_experts=E, file=tmp_path / "old.pt", distance=1)
