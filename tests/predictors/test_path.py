"""ExpertFlow's routing path predictor: learns a token-determined path, forecasts every layer before the pass,
its per-request KV cache (the engine's way) gives what one causal run gives, training is seeded and resumable."""

from __future__ import annotations

import pytest
import torch

from moepager.predictors import PathPredictor, PredictorError, make_predictor
from moepager.predictors.path import PAPER, T5, PathModel, PathShape, fit_path

E, L = 8, 3
TINY = PathShape(layers=1, d_model=32, d_ff=64, heads=2, d_kv=8, vocab=256, window=16)
TINY_T5 = PathShape(layers=1, d_model=32, d_ff=64, heads=2, d_kv=8, vocab=256, window=16, encoder_layers=1)
PROMPT = 10


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


@pytest.mark.parametrize("fixture", ["fitted", "fitted_t5"])
def test_a_lookahead_forecasts_the_next_pass_and_the_pass_reuses_it(fixture, request):
    """The token scheduler asks for a decoding request's next token's path before its pass: the forecast is the
    one the pass makes without a lookahead, the pass reuses it (the same tensor), and a pass that feeds another
    token (a replay's) forecasts from the state as it was."""
    predictor: PathPredictor = request.getfixturevalue(fixture)
    t = list(range(3, 16))

    def run(lookahead: dict[int, int] | None, fed: dict[int, int] | None = None) -> list[torch.Tensor]:
        predictor.end_request(1)
        predictor.begin_rows((1,), (0,), (PROMPT,), ("prefill",))
        predictor.start_iteration(torch.tensor(t[:PROMPT]), None)
        out = []
        for pos in range(PROMPT, len(t)):
            ahead = None
            if lookahead and pos in lookahead:
                ahead = predictor.lookahead(1, pos, lookahead[pos])
                assert ahead is not None and predictor.lookahead(1, pos, lookahead[pos]) is ahead  # asked again
            predictor.begin_rows((1,), (pos,), (1,), ("decode",))
            predictor.start_iteration(torch.tensor([(fed or {}).get(pos, t[pos])]), None)
            probs_LE = torch.stack([predictor.forecast(j, 0).probs_NE[0] for j in range(L)])
            if ahead is not None and lookahead[pos] == t[pos]:
                assert torch.equal(ahead, probs_LE)
            out.append(probs_LE)
        return out

    predictor.ahead_missed = 0
    plain = run(None)
    assert predictor.lookahead(1, 99, 5) is None and predictor.lookahead(42, 0, 5) is None  # not followed there
    assert all(torch.equal(a, b) for a, b in zip(run({p: t[p] for p in range(PROMPT, len(t))}), plain))
    # ahead on a token the pass does not feed (the pass feeds the true one): the state is put back first
    got = run({PROMPT + 1: t[PROMPT + 1] + 1, PROMPT + 2: t[PROMPT + 2]}, fed={PROMPT + 1: t[PROMPT + 1]})
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, plain))
    assert predictor.ahead_missed == 1
    predictor.end_request(1)


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


@pytest.fixture(scope="module")
def fitted_t5() -> PathPredictor:
    toks, ids = requests(60)
    return fit_path(toks, ids, E, TINY_T5, epochs=60, lr=1e-2, prompts=[PROMPT] * len(toks))


def _two_rows(predictor: PathPredictor, request: int, t: list[int]) -> None:
    """The offline evaluation's way: the prompt and the generated tokens as two rows of one iteration."""
    p = min(PROMPT, len(t))
    rows = [r for r in ((0, p, "prefill"), (p, len(t) - p, "decode")) if r[1]]
    predictor.begin_rows([request] * len(rows), [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    predictor.start_iteration(torch.tensor(t), None)


def test_the_t5_layout_forecasts_prompt_and_generated_tokens(fitted_t5):
    """The encoder's heads forecast the prompt's paths, the decoder's (cross-attending to the prompt) the
    generated tokens'."""
    toks, ids = requests(10, seed=1)
    right = {"prefill": [], "decode": []}
    for r, (t, i) in enumerate(zip(toks, ids)):
        _two_rows(fitted_t5, r, t)
        for layer in range(L):
            top = fitted_t5.forecast(layer, 0).top(2).sort(1).values
            ok = (top == i[:, layer].sort(1).values).all(1).float()
            right["prefill"].append(ok[:PROMPT].mean())
            if len(t) > PROMPT:
                right["decode"].append(ok[PROMPT:].mean())
        fitted_t5.end_request(r)
    assert torch.stack(right["prefill"]).mean() > 0.9 and torch.stack(right["decode"]).mean() > 0.9


def test_the_t5_layouts_incremental_passes_match_the_offline_run(fitted_t5):
    """A prompt in two chunks (the second chunk sees the whole prompt, as the offline run does), then one
    generated token a pass against the decoder's KV cache: the offline forecasts, from the second chunk on."""
    t = list(range(3, 25))
    _two_rows(fitted_t5, 0, t)
    offline = fitted_t5.forecast(2, 0).probs_NE
    fitted_t5.end_request(0)
    fitted_t5.begin_rows((5,), (0,), (2,), ("prefill",))
    fitted_t5.start_iteration(torch.tensor(t[:2]), None)
    got = []
    fitted_t5.begin_rows((5,), (2,), (PROMPT - 2,), ("prefill",))
    fitted_t5.start_iteration(torch.tensor(t[2:PROMPT]), None)
    got.append(fitted_t5.forecast(2, 0).probs_NE)
    for pos in range(PROMPT, len(t)):
        fitted_t5.begin_rows((5,), (pos,), (1,), ("decode",))
        fitted_t5.start_iteration(torch.tensor([t[pos]]), None)
        got.append(fitted_t5.forecast(2, 0).probs_NE)
    assert torch.allclose(torch.cat(got), offline[2:], atol=1e-5)
    fitted_t5.end_request(5)
    assert not fitted_t5._cache


def test_the_t5_shape_is_the_papers_encoder_decoder():
    model = PathModel(T5, 12, 128)
    block = 3 * 32 * 512 + 512 * 32 + (32 * 2048 + 2048) + (2048 * 32 + 32) + 2 * 2 * 32
    cross = 32 * 512 + 32 * 1024 + 512 * 32 + 2 * 32
    heads = 32 * 12 * 128 + 12 * 128
    expected = 32768 * 32 + 6 * block + 6 * (block + cross) + 2 * 2 * 32 + 2 * heads
    assert sum(p.numel() for p in model.parameters()) == expected
