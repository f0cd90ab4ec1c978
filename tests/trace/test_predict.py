"""Predictors on traces: the split, recall/precision arithmetic on hand-made routing, the CLIs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moepager.cli.main import main
from moepager.predictors import ExpertMapPredictor, Forecast, PredictorError
from moepager.trace.fit import fit_expert_maps, fit_transition
from moepager.trace.format import DECODE, TraceHeader, TraceReader, TraceRequest, TraceWriter
from moepager.trace.predict import LayerTally, _tally, evaluate, split_requests
from tests.trace.conftest import random_trace

E, L = 6, 3


def cyclic_trace(path, requests: int = 6, tokens: int = 30):
    """Expert (t + l + r) % E at layer l of token t of request r (top-1), with token ids: fully predictable."""
    header = TraceHeader("cyclic", tuple(range(L)), E, 1)
    with TraceWriter(path, header) as w:
        for r in range(requests):
            ids = np.array([[[(t + layer + r) % E] for layer in range(L)] for t in range(tokens)], np.int16)
            w.add(TraceRequest(ids, np.full(tokens, DECODE, np.uint8), token_ids_T=np.arange(tokens) + r,
                               name=f"r{r}"))
    return path


def test_split_is_seeded_disjoint_and_complete():
    train, test = split_requests(10, 0.3, seed=4)
    assert sorted(train + test) == list(range(10)) and len(test) == 3
    assert (train, test) == split_requests(10, 0.3, seed=4)
    assert split_requests(10, 0.3, seed=5) != (train, test)


def test_recall_and_precision_count_overlaps_per_target():
    tally = LayerTally()
    chosen = torch.tensor([[0, 1], [2, 3]])
    forecast = Forecast(torch.tensor([[0.5, 0.1, 0.4, 0.0], [0.1, 0.2, 0.3, 0.4]]))
    _tally(tally, forecast, chosen, ahead=0, ks=[1, 2])
    assert (tally.targets, tally.forecast, tally.chosen) == (2, 2, 4)
    assert tally.hits == {1: 2, 2: 3}  # top-1: {0} and {3}; top-2: {0, 2} and {3, 2}
    next_tally = LayerTally()
    _tally(next_tally, forecast, chosen, ahead=1, ks=[2])  # row 0 forecasts row 1
    assert (next_tally.targets, next_tally.hits) == (1, {2: 1})


def test_a_predictable_trace_is_predicted_perfectly_at_every_distance(tmp_path):
    path = cyclic_trace(tmp_path / "c.mpt")
    with TraceReader(path) as reader:
        train, test = split_requests(len(reader), 0.3)
        transition = fit_transition(reader, train, [1, 2, 3])
        for d in (1, 2, 3):
            result = evaluate(transition, reader, test, d, [1])
            assert result.coverage() == 1.0 and result.recall(1) == pytest.approx(1.0)
            assert result.precision(1) == pytest.approx(1.0)


def test_expert_maps_match_routing_trajectories(tmp_path):
    path = cyclic_trace(tmp_path / "c.mpt")
    with TraceReader(path) as reader:
        store = fit_expert_maps(reader, [0, 1, 2, 3], capacity=200)
        result = evaluate(ExpertMapPredictor(store), reader, [4, 5], 1, [1])
    # layers 1 and 2 follow layer 0 in every stored map: the trajectory search finds them exactly (layer 0 of
    # the next token comes from the hashed-token semantic search, which this trace does not make predictable)
    assert [result.recall(1, t) for t in result.tallies[1:]] == [1.0, 1.0]
    size, recall = result.selected(result.tallies[2])
    assert size == 1.0 and recall == 1.0


def test_predict_eval_and_fit_clis(tmp_path, capsys):
    path = random_trace(tmp_path / "t.mpt", lengths=(20, 15, 25, 30, 12))
    with TraceWriter(tmp_path / "tok.mpt", TraceReader(path).header) as w:
        for r in TraceReader(path):
            w.add(TraceRequest(r.ids_TLK, r.phase_T, token_ids_T=np.arange(r.num_tokens), name=r.name))
    out_json = tmp_path / "eval.json"
    assert main(["predict-eval", "--trace", str(tmp_path / "tok.mpt"), "--predictor", "transition,expert-map",
                 "--distance", "1,3", "--json", str(out_json), "--per-layer"]) == 0
    text = capsys.readouterr().out
    assert "transition" in text and "expert-map" in text and "recall@2" in text
    results = json.loads(out_json.read_text())
    assert len(results) == 4 and {r["distance"] for r in results} == {1, 3}
    assert set(results[0]["per_layer"]) == {"1", "2", "3"}
    assert main(["predictor", "fit", "--kind", "transition", "--trace", str(path), "--out",
                 str(tmp_path / "p.pt"), "--distances", "1"]) == 0
    assert (tmp_path / "p.pt").exists()
    assert main(["predictor", "fit", "--kind", "token-wise", "--trace", str(path),
                 "--out", str(tmp_path / "x.pt")]) == 2
    assert "--record-hidden" in capsys.readouterr().err
    assert main(["predict-eval", "--trace", str(path), "--predictor", "gate-lookahead"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["predict-eval", "--trace", str(path), "--predictor", "transition", "--distance", "0"]) == 2


def test_the_head_is_fitted_as_the_clis_say(tmp_path, capsys):
    """`predictor fit` and `predict-eval` fit the head with an MLP (--head-hidden) and without the token
    (--no-tokens): the file says so, and evaluation runs on what was asked."""
    path = random_trace(tmp_path / "t.mpt", lengths=(20, 15, 25, 30, 12))
    assert main(["predictor", "fit", "--kind", "head", "--trace", str(path), "--out", str(tmp_path / "h.pt"),
                 "--distances", "1", "--head-hidden", "8", "--head-epochs", "1"]) == 0
    state = torch.load(tmp_path / "h.pt")
    assert state["hidden"] == 8 and state["models"]["1"]["w1"].shape[-1] == 8
    assert main(["predict-eval", "--trace", str(path), "--predictor", "head", "--head-hidden", "4",
                 "--no-tokens"]) == 0
    assert "head" in capsys.readouterr().out
    # without --distances the head is fitted for 1, 2, 3 within the trace's layers and for L, the next token
    for layers, want in ((5, {1, 2, 3, 5}), (2, {1, 2})):
        deep = random_trace(tmp_path / f"t{layers}.mpt", layers=layers)
        assert main(["predictor", "fit", "--kind", "head", "--trace", str(deep), "--out", str(tmp_path / "d.pt"),
                     "--head-epochs", "1", "--force"]) == 0
        assert {int(d) for d in torch.load(tmp_path / "d.pt")["models"]} == want  # (no tokens: no pass head)


def test_each_fitted_predictor_has_its_own_fit_configuration_and_refuses_the_others_options(tmp_path, capsys):
    from moepager.predictors import FITTED, PREDICTORS
    from moepager.trace.fit import FITTERS

    assert set(FITTERS) == set(FITTED)
    for name, fitter in FITTERS.items():
        assert fitter.config is PREDICTORS[name].fit_config
    with pytest.raises(PredictorError, match="transition takes no epochs"):
        FITTERS["transition"].configure("transition", epochs=3)
    assert FITTERS["head"].applicable(epochs=2, capacity=9).epochs == 2  # capacity is expert-map's: not applicable
    path = random_trace(tmp_path / "t.mpt")
    assert main(["predictor", "fit", "--kind", "transition", "--trace", str(path), "--out", str(tmp_path / "p.pt"),
                 "--head-epochs", "2"]) == 2
    assert "--head-epochs does nothing for --kind transition" in capsys.readouterr().err
    assert not (tmp_path / "p.pt").exists()
