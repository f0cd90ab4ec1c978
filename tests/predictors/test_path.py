"""ExpertFlow's routing path predictor: learns a token-determined path, forecasts every layer before the pass,
its per-request KV cache (the engine's way) gives what one causal run gives, training is seeded and resumable."""

from __future__ import annotations

import pytest
import torch

from moepager.predictors import PathPredictor, PredictorError, make_predictor
from moepager.predictors.path import PAPER, PathModel, PathShape, fit_path

E, L = 8, 3
TINY = PathShape(layers=1, d_model=32, d_ff=64, heads=2, d_kv=8, vocab=256, window=16)


def requests(n: int, seed: int = 0) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Layer l of a token routes to (token + l) % E and (token * 3 + l) % E: the token decides the path."""
    g = torch.Generator().manual_seed(seed)
    toks, ids = [], []
    for _ in range(n):
        t = torch.randint(0, 40, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g)
        toks.append(t.tolist())
        ids.append(torch.stack([torch.stack([(t + layer) % E, (t * 3 + layer + 1) % E], 1) for layer in range(L)], 1))
    return toks, ids


@pytest.fixture(scope="module")
def fitted() -> PathPredictor:
    toks, ids = requests(60)
    return fit_path(toks, ids, E, TINY, epochs=40, lr=1e-2)


def test_it_forecasts_every_layer_before_the_pass_runs(fitted):
    toks, ids = requests(10, seed=1)
    right = []
    for t, i in zip(toks, ids):
        fitted.start_iteration(torch.tensor(t), None)  # nothing observed yet
        for layer in range(L):
            top = fitted.forecast(layer, 0).top(2).sort(1).values
            right.append((top == i[:, layer].sort(1).values).all(1).float().mean())
        assert fitted.forecast(0, 1) is None  # the next token is not known before this pass ends
    assert torch.stack(right).mean() > 0.9


def test_the_engines_incremental_passes_match_one_causal_run(fitted):
    toks = [list(range(20)), list(range(5, 9))]
    offline = []
    for t in toks:
        fitted.start_iteration(torch.tensor(t), None)
        offline.append(fitted.forecast(1, 0).probs_NE)
    # prefill both requests in one pass, then decode them one token a pass (windows of 16: the cache slides)
    fitted.begin_rows((7, 9), (0, 0), (3, 2))
    fitted.start_iteration(torch.tensor(toks[0][:3] + toks[1][:2]), None)
    got = {7: [fitted.forecast(1, 0).probs_NE[:3]], 9: [fitted.forecast(1, 0).probs_NE[3:]]}
    for pos in range(3, 20):
        rows = [(7, pos)] + ([(9, pos - 1)] if pos - 1 < 4 else [])
        fitted.begin_rows([r for r, _ in rows], [p for _, p in rows], [1] * len(rows))
        fitted.start_iteration(torch.tensor([toks[0 if r == 7 else 1][p] for r, p in rows]), None)
        for n, (r, _) in enumerate(rows):
            got[r].append(fitted.forecast(1, 0).probs_NE[n:n + 1])
    assert torch.allclose(torch.cat(got[7])[:16], offline[0][:16], atol=1e-5)
    assert torch.allclose(torch.cat(got[9]), offline[1], atol=1e-5)
    fitted.end_request(7)
    assert 7 not in fitted._cache


def test_training_is_seeded_and_resumes_where_it_stopped(tmp_path):
    toks, ids = requests(20)
    whole = fit_path(toks, ids, E, TINY, epochs=3, lr=1e-2)
    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(Stopped):  # interrupted after two epochs
        fit_path(toks, ids, E, TINY, epochs=3, lr=1e-2, resume=ckpt, progress=_stop_after(2))
    assert ckpt.exists()
    resumed = fit_path(toks, ids, E, TINY, epochs=3, lr=1e-2, resume=ckpt)
    for a, b in zip(whole.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(PredictorError, match="not a checkpoint of this training"):
        fit_path(toks, ids, E, TINY, epochs=5, lr=1e-2, resume=ckpt)


class Stopped(Exception):
    pass


def _stop_after(epochs: int):
    seen = []

    def progress(advance: int) -> None:
        seen.append(advance)
        if len(seen) == epochs:
            raise Stopped
    return progress


def test_saved_model_loads_through_the_registry(fitted, tmp_path):
    fitted.save(tmp_path / "p.pt")
    loaded = make_predictor("path", num_layers=L, num_experts=E, file=tmp_path / "p.pt", distance=L)
    for p in (fitted, loaded):
        p.start_iteration(torch.tensor([1, 2, 3]), None)
    assert torch.equal(fitted.forecast(2, 0).probs_NE, loaded.forecast(2, 0).probs_NE)
    with pytest.raises(PredictorError, match="this model has 4 x 8"):
        make_predictor("path", num_layers=4, num_experts=E, file=tmp_path / "p.pt")


def test_the_paper_shape_has_expertflows_widths():
    model = PathModel(PAPER, 12, 128)
    block = 3 * 32 * 512 + 512 * 32 + (32 * 2048 + 2048) + (2048 * 32 + 32) + 2 * 2 * 32
    expected = 32768 * 32 + 6 * block + 2 * 32 + 12 * (32 * 128 + 128)
    assert sum(p.numel() for p in model.parameters()) == expected  # 2.3 M: a few MB, like the paper's 7.21 MB
