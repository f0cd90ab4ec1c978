"""fMoE expert maps: semantic search before any layer, trajectory search after, redundancy-based replacement."""

from __future__ import annotations

import torch

from moepager.predictors import ExpertMapPredictor, ExpertMapStore, LayerObservation, k_hot, make_predictor
from moepager.predictors.expert_map import hashed_tokens, prefix_means

L, E = 3, 4


def one_hot_map(experts: list[int]) -> torch.Tensor:
    out = torch.zeros(L, E)
    out[torch.arange(L), torch.tensor(experts)] = 1.0
    return out


def test_trajectory_search_finds_the_map_that_routed_alike_and_forecasts_its_next_layer():
    store = ExpertMapStore(L, E, "hashed-tokens", capacity=10)
    store.add(torch.eye(2), torch.stack([one_hot_map([0, 1, 2]), one_hot_map([3, 2, 1])]))
    p = ExpertMapPredictor(store)
    p.start_iteration(torch.tensor([7]), torch.tensor([[1.0, 0.0]]))
    first = p.forecast(1, 0)  # nothing observed: semantic search, closest to the first map
    assert first.top(1).item() == 1 and first.confidence_N.item() == 1.0
    p.observe(0, LayerObservation(torch.tensor([[0.0, 0.0, 0.1, 0.9]]), torch.tensor([[3]])))
    f = p.forecast(2, 0)  # the observed layer 0 matches the second map
    assert f.top(1).item() == 1 and 0.9 < f.confidence_N.item() < 1.0


def test_full_store_overwrites_the_most_redundant_map():
    store = ExpertMapStore(L, E, "hashed-tokens", capacity=2, distance=1)
    store.add(torch.eye(2), torch.stack([one_hot_map([0, 0, 0]), one_hot_map([3, 3, 3])]))
    store.add(torch.tensor([[0.0, 1.0]]), one_hot_map([3, 3, 2])[None])
    assert len(store.maps_CLE) == 2
    assert torch.equal(store.maps_CLE[0], one_hot_map([0, 0, 0]))
    assert torch.equal(store.maps_CLE[1], one_hot_map([3, 3, 2]))


def test_online_learning_turns_finished_iterations_into_maps(tmp_path):
    p = make_predictor("expert-map", num_layers=L, num_experts=E, learn=True)
    assert p.forecast(0, 0) is None  # an empty store forecasts nothing
    for step in range(3):
        p.start_iteration(torch.tensor([step]), torch.ones(1, 8))
        for layer in range(L):
            p.observe(layer, LayerObservation(torch.full((1, E), 0.25), torch.tensor([[layer]])))
    p.start_iteration(torch.tensor([9]), torch.ones(1, 8))
    assert len(p.store.maps_CLE) == 3 and p.forecast(0, 0) is not None
    p.store.save(tmp_path / "m.pt")
    again = make_predictor("expert-map", num_layers=L, num_experts=E, file=tmp_path / "m.pt")
    assert torch.equal(again.store.maps_CLE, p.store.maps_CLE) and again.store.sem_kind == "embedding"


def test_hashed_semantics_are_running_means_of_token_hashes():
    vec = hashed_tokens(["a", "b", "a"])
    assert vec.shape == (3, 256) and torch.equal(vec[0], vec[2]) and vec.abs().sum(1).tolist() == [1, 1, 1]
    means = prefix_means(vec)
    assert torch.allclose(means[1], (vec[0] + vec[1]) / 2)


def test_neighbours_turn_one_hot_matches_into_a_ranking_and_trajectory_only_needs_no_tokens():
    # top-1 maps over 2 layers of 4 experts: after expert 0 at layer 0, layer 1 is expert 1 twice, expert 2 once
    ids = torch.tensor([[[0], [1]], [[0], [1]], [[0], [2]], [[3], [3]]])
    maps = torch.stack([k_hot(ids[:, layer], 4) for layer in range(2)], 1)
    store = ExpertMapStore(2, 4, "none", capacity=10, neighbours=3)
    store.add(torch.zeros(4, 1), maps)
    p = ExpertMapPredictor(store)
    assert p.semantic is None
    p.start_iteration(torch.tensor([0]), None)
    before = p.forecast(1, 0).probs_NE[0]  # nothing observed: the store's mean map
    assert torch.allclose(before, maps[:, 1].mean(0))
    p.observe(0, LayerObservation(k_hot(torch.tensor([[0]]), 4), torch.tensor([[0]])))
    ranked = p.forecast(1, 0).top(3)[0].tolist()
    assert ranked[:2] == [1, 2]  # the three matching maps vote: 1 twice, then 2
    assert p.forecast(0, 1) is None  # no semantic search in trajectory-only mode
    single = ExpertMapPredictor(ExpertMapStore.from_state({**_state(store), "neighbours": 1}))
    single.start_iteration(torch.tensor([0]), None)
    single.observe(0, LayerObservation(k_hot(torch.tensor([[0]]), 4), torch.tensor([[0]])))
    assert (single.forecast(1, 0).probs_NE[0] > 0).sum() == 1  # fMoE's best map names one expert only


def _state(store):
    return {"maps": store.maps_CLE, "sem": store.sem_CD, "capacity": store.capacity, "distance": store.distance,
            "sem_kind": store.sem_kind}
