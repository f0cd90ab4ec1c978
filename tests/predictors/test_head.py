"""The learned head: it learns what a co-occurrence table cannot (an older layer, the token), forecasts
the pass from the token alone, keeps to the stateless protocol, saves and loads through the registry."""

from __future__ import annotations

import pytest
import torch

from moepager.predictors import HeadPredictor, LayerObservation, PredictorError, k_hot, make_predictor
from moepager.predictors.head import GATHER_ROWS, fit_head, source_layers, token_buckets, training_pairs

E = 8


def xor_routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """4 layers, top-2, all random except: layer 2 repeats layer 0 (layer 1, the last observed, says nothing
    about it), and layer 3 is the token id % E and a neighbour (only the token tells it)."""
    g = torch.Generator().manual_seed(seed)
    rows, toks = [], []
    for _ in range(tokens):
        first, second = (torch.randperm(E, generator=g)[:2].tolist() for _ in range(2))
        tok = int(torch.randint(0, 100, (1,), generator=g))
        d = tok % E
        rows.append([first, second, first, [d, (d + 3) % E]])
        toks.append(tok)
    return torch.tensor(rows), toks


def observe(p, ids_TLK: torch.Tensor, toks: list[int], upto: int) -> None:
    p.start_iteration(torch.tensor(toks), None)
    for layer in range(upto + 1):
        p.observe(layer, LayerObservation(k_hot(ids_TLK[:, layer], E), ids_TLK[:, layer]))


@pytest.fixture(scope="module")
def fitted() -> HeadPredictor:
    ids, toks = xor_routing(3000)
    return fit_head(ids, torch.zeros(len(ids), dtype=torch.long), E, (0, 1, 2), toks, epochs=30, buckets=1024,
                    rank=16, lr=0.05)


def test_the_head_learns_from_a_set_of_experts_and_from_the_token(fitted):
    ids, toks = xor_routing(400, seed=1)
    observe(fitted, ids, toks, 1)
    layer2 = fitted.forecast(2, 0).top(2).sort(1).values
    assert (layer2 == ids[:, 2].sort(1).values).all(1).float().mean() > 0.9  # layer 0, two layers back
    observe(fitted, ids, toks, 2)
    layer3 = fitted.forecast(3, 0).top(2).sort(1).values
    assert (layer3 == ids[:, 3].sort(1).values).all(1).float().mean() > 0.9  # the token decides layer 3


def test_the_pass_head_forecasts_every_layer_before_any_runs(fitted):
    ids, toks = xor_routing(400, seed=1)
    fitted.start_iteration(torch.tensor(toks), None)
    assert fitted.forecast(1, 1) is None  # nothing observed: no next-iteration forecast
    layer3 = fitted.forecast(3, 0).top(2).sort(1).values
    assert (layer3 == ids[:, 3].sort(1).values).all(1).float().mean() > 0.9


def test_next_iteration_targets_read_the_previous_row_only():
    ids = torch.arange(12).reshape(4, 3, 1)
    src, bucket_NL, target, valid = training_pairs(ids, torch.tensor([0, 0, 1, 1]), torch.tensor([5, 6, 7, 8]), 2)
    assert source_layers(0, 2, 3) == ([1, 0, -1, 0], 1)
    assert valid[:, 0].tolist() == [False, True, False, True]  # rows 0 and 2 start a request
    assert src[1, 0, :, 0].tolist() == [1, 0, -1, 0]  # row 0's layers 1, 0 and its layer 0 (same layer)
    assert bucket_NL[1].tolist() == [5, 5, 6]  # layers 0 and 1 are ahead: the observed row (row 0) gives the token
    assert src[1, 2, :, 0].tolist() == [3, -1, -1, -1]  # layer 2 at distance 2: row 1's layer 0


def test_saved_heads_load_through_the_registry(fitted, tmp_path):
    fitted.save(tmp_path / "h.pt")
    loaded = make_predictor("head", num_layers=4, num_experts=E, file=tmp_path / "h.pt", distance=1)
    ids, toks = xor_routing(50, seed=2)
    for p in (fitted, loaded):
        observe(p, ids, toks, 0)
    assert torch.equal(fitted.forecast(1, 0).probs_NE, loaded.forecast(1, 0).probs_NE)
    with pytest.raises(PredictorError, match="fitted for distances \\[1, 2\\], not 3"):
        make_predictor("head", num_layers=4, num_experts=E, file=tmp_path / "h.pt", distance=3)
    with pytest.raises(PredictorError, match="4 MoE layers x 8 experts; this model has 4 x 6"):
        make_predictor("head", num_layers=4, num_experts=6, file=tmp_path / "h.pt", distance=1)


def test_fitting_is_seeded():
    ids, toks = xor_routing(200)
    a, b = (fit_head(ids, torch.zeros(200, dtype=torch.long), E, (1,), toks, epochs=2, buckets=64, rank=4)
            for _ in range(2))
    assert torch.equal(a.models[1].weight, b.models[1].weight)


def parity_routing(tokens: int, seed: int = 0) -> torch.Tensor:
    """3 layers, top-2: layers 0 and 1 each choose two experts of 0-3 or two of 4-7 (even odds); layer 2 is
    {4, 5} when they chose the same half, else {6, 7}. Which experts occur together decides it, and no sum of
    per-expert weights can express it (an XOR)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(tokens):
        halves = torch.randint(0, 2, (2,), generator=g).tolist()
        first, second = ((4 * h + torch.randperm(4, generator=g)[:2]).tolist() for h in halves)
        rows.append([first, second, [4, 5] if halves[0] == halves[1] else [6, 7]])
    return torch.tensor(rows)


def test_the_mlp_head_learns_what_experts_occurring_together_say():
    ids = parity_routing(4000)
    test = parity_routing(500, seed=1)
    right = {}
    for hidden in (0, 32):
        p = fit_head(ids, torch.zeros(len(ids), dtype=torch.long), E, (1,), None, epochs=40, hidden=hidden, lr=0.02)
        observe(p, test, [0] * len(test), 1)
        got = p.forecast(2, 0).top(2).sort(1).values
        right[hidden] = (got == test[:, 2]).all(1).float().mean().item()
    assert right[32] > 0.95 and right[0] < 0.7  # the linear head does no better than a coin


def test_a_saved_mlp_head_loads_and_forecasts_the_same(tmp_path):
    ids = parity_routing(300)
    fitted = fit_head(ids, torch.zeros(len(ids), dtype=torch.long), E, (1,), None, epochs=1, hidden=8)
    fitted.save(tmp_path / "h.pt")
    loaded = make_predictor("head", num_layers=3, num_experts=E, file=tmp_path / "h.pt", distance=1)
    assert loaded.models[1].hidden == 8
    for p in (fitted, loaded):
        observe(p, ids[:20], [0] * 20, 0)
    assert torch.equal(fitted.forecast(1, 0).probs_NE, loaded.forecast(1, 0).probs_NE)
    with pytest.raises(PredictorError, match="hidden width"):
        fit_head(ids, torch.zeros(len(ids), dtype=torch.long), E, (1,), None, hidden=-1)


@pytest.mark.parametrize("rows", [5, GATHER_ROWS + 6])
@pytest.mark.parametrize("hidden, tokens", [(0, True), (0, False), (8, True), (8, False)])
def test_forecasts_gather_the_rows_the_dense_product_would_sum(hidden, tokens, rows):
    """The engine's forecasts sum the weight rows their experts name (a prefill's many rows multiply a multi-hot
    matrix of the slots they have); the fitted model multiplies the whole multi-hot vector: the same logits (to float
    rounding) for every layer and distance, with absent slots and ids, and for the pass."""
    ids, toks = xor_routing(200)
    p = fit_head(ids, torch.zeros(len(ids), dtype=torch.long), E, (0, 1, 2), toks if tokens else None, epochs=1,
                 buckets=64, rank=4, hidden=hidden)
    test, test_toks = ids[:rows].clone(), toks[:rows]
    test[0, 0, 1] = -1  # an id a trace did not record
    buckets = token_buckets(test_toks, 64) if tokens else None
    for upto in (-1, 0, 1, 3):
        observe(p, test, test_toks, upto)
        for layer in range(4):
            for ahead in (0, 1):
                got = p.forecast(layer, ahead)
                distance = (0 if upto < 0 else layer - upto) if ahead == 0 else (None if upto < 0 else 4 - upto + layer)
                if distance not in p.models:
                    assert got is None
                    continue
                slots, _ = source_layers(layer, distance, 4)
                src = torch.stack([test[:, s] if 0 <= s <= upto else torch.full((rows, 2), -1) for s in slots], 1)
                want = torch.sigmoid(p.models[distance].logits(src, buckets, layer))
                torch.testing.assert_close(got.probs_NE, want, rtol=1e-5, atol=1e-6)
