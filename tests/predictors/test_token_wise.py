"""SMoE's token-wise predictor learns the next token's experts from the current token's router input."""

from __future__ import annotations

import torch

from moepager.predictors import LayerObservation, make_predictor
from moepager.predictors.token_wise import train_token_wise


def test_learns_a_rule_the_next_token_follows_and_only_forecasts_one_token_ahead(tmp_path):
    gen = torch.Generator().manual_seed(0)
    n, layers, e, d = 300, 2, 4, 8
    x = torch.randn(n, layers, d, generator=gen)
    # the next token's expert at each layer is the argmax of the first E features of this token's input
    ids = torch.zeros(n, layers, 1, dtype=torch.long)
    ids[1:, :, 0] = x[:-1, :, :e].argmax(-1)
    nxt = torch.cat([torch.arange(1, n), torch.tensor([-1])])
    p = train_token_wise(x, ids, nxt, torch.zeros(layers, e, d), epochs=300, lr=0.05)
    p.start_iteration(torch.arange(n), None)
    for layer in range(layers):
        p.observe(layer, LayerObservation(torch.full((n, e), 0.25), ids[:, layer], x[:, layer]))
    accuracy = (p.forecast(1, 1).top(1)[:-1, 0] == ids[1:, 1, 0]).float().mean()
    assert accuracy > 0.9
    assert p.forecast(1, 0) is None  # same-token targets are not what it predicts
    p.save(tmp_path / "tw.pt")
    loaded = make_predictor("token-wise", num_layers=layers, num_experts=e, file=tmp_path / "tw.pt")
    assert torch.equal(loaded.weights_LED, p.weights_LED)
