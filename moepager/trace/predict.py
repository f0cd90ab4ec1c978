"""Predictors on traces: fit them on some requests, measure them on the others (split by request).

Evaluation feeds each held-out request's tokens as the rows of one iteration (predictors keep no state
across iterations, so row t's "next iteration" is row t+1; see predictors/base.py). At prefetch distance d,
the forecast for layer j of token t is the one made right after observing layer i = j - d of token t, or,
when j < d, after layer L + j - d of token t-1. Metrics per target layer, over the targets a predictor
forecasts (coverage = forecast targets / all targets):
- recall@k: |top-k forecast ∩ chosen experts| / |chosen experts|;
- precision@k: |top-k forecast ∩ chosen| / k;
- for forecasts with a confidence (fMoE's expert maps), the similarity-selected set's mean size and recall.
Shape legend: T tokens, L MoE layers, K top-k, E experts, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moepager.predictors import (
    PREDICTORS,
    Forecast,
    LayerObservation,
    Predictor,
    PredictorError,
    k_hot,
    target_of,
)
from moepager.predictors.base import token_keys
from moepager.predictors.expert_map import hashed_tokens, prefix_means
from moepager.trace.format import PREFILL, TraceHeader, TraceReader, TraceRequest
from moepager.trace.simulate import Forecasts

Progress = Callable[[int], None]
PASS = 0
"""The distance that stands for "the whole coming pass, before any of its layers runs" (a path predictor's
setting: every layer forecast from the token and what came before it)."""


def split_requests(n: int, test_fraction: float = 0.3, seed: int = 0) -> tuple[list[int], list[int]]:
    """A seeded random split of request indices into (train, test); both non-empty when n >= 2."""
    if not 0 < test_fraction < 1:
        raise PredictorError(f"test fraction must be between 0 and 1, got {test_fraction}")
    if n < 2:
        raise PredictorError(f"a train/test split needs at least 2 requests, the trace has {n}")
    order = np.random.default_rng(seed).permutation(n)
    n_test = min(n - 1, max(1, round(n * test_fraction)))
    return sorted(order[n_test:].tolist()), sorted(order[:n_test].tolist())


def observations(request: TraceRequest, header: TraceHeader) -> list[LayerObservation]:
    """One observation per MoE layer with the request's tokens as rows. Distributions: the full gates; else the
    recorded top-k weights (zero elsewhere); else K-hot / K."""
    ids = torch.from_numpy(request.ids_TLK.astype(np.int64))
    out = []
    for layer in range(header.num_layers):
        if request.gates_TLE is not None:
            probs = torch.from_numpy(request.gates_TLE[:, layer])
        elif request.weights_TLK is not None:
            valid = ids[:, layer] >= 0
            weights = torch.from_numpy(request.weights_TLK[:, layer]).float() * valid
            probs = torch.zeros(len(ids), header.num_experts).scatter_add_(1, ids[:, layer].clamp(min=0), weights)
        else:
            probs = k_hot(ids[:, layer], header.num_experts)
        x = torch.from_numpy(request.hidden_TLD[:, layer].astype(np.float32)) if request.hidden_TLD is not None \
            else None
        out.append(LayerObservation(probs.float(), ids[:, layer], x))
    return out


def row_token_ids(request: TraceRequest) -> torch.Tensor:
    """The rows' token ids; for a trace of token strings, a stable 63-bit hash of each string stands in (fit and
    evaluation see the same ids); empty without either."""
    if request.token_ids_T is not None:
        return torch.from_numpy(request.token_ids_T.astype(np.int64))
    if request.tokens:
        return token_keys(request.tokens)
    return torch.zeros(0, dtype=torch.long)


def semantic_rows(request: TraceRequest) -> torch.Tensor | None:
    """The hashed-tokens semantic embedding of each row (prefix means); None without token ids or strings."""
    tokens = request.token_ids_T.tolist() if request.token_ids_T is not None else request.tokens
    return prefix_means(hashed_tokens(tokens)) if tokens else None


def prompt_length(request: TraceRequest, prompt: int | None = None) -> int:
    """How many of the request's first tokens are its prompt: `prompt` (a replay's `--route-prompt`), else
    its recorded prefill tokens."""
    if prompt is not None:
        return min(prompt, request.num_tokens)
    decode = np.flatnonzero(request.phase_T != PREFILL)
    return int(decode[0]) if len(decode) else request.num_tokens


# -- evaluation -------------------------------------------------------------------------------------------------
@dataclass
class LayerTally:
    targets: int = 0
    forecast: int = 0
    chosen: int = 0
    """Chosen experts of forecast targets (the recall denominator)."""
    hits: dict[int, int] = field(default_factory=dict)
    """k -> |top-k ∩ chosen| summed."""
    selected: int = 0
    selected_hits: int = 0


@dataclass
class PredictEval:
    predictor: str
    distance: int
    ks: list[int]
    layers: list[int]
    tallies: list[LayerTally]
    requests: int
    tokens: int

    def recall(self, k: int, tally: LayerTally | None = None) -> float | None:
        tallies = [tally] if tally else self.tallies
        chosen = sum(t.chosen for t in tallies)
        return sum(t.hits.get(k, 0) for t in tallies) / chosen if chosen else None

    def precision(self, k: int, tally: LayerTally | None = None) -> float | None:
        tallies = [tally] if tally else self.tallies
        forecast = sum(t.forecast for t in tallies)
        return sum(t.hits.get(k, 0) for t in tallies) / (forecast * k) if forecast else None

    def coverage(self, tally: LayerTally | None = None) -> float:
        tallies = [tally] if tally else self.tallies
        return sum(t.forecast for t in tallies) / max(1, sum(t.targets for t in tallies))

    def selected(self, tally: LayerTally | None = None) -> tuple[float, float] | None:
        """Mean size and recall of the similarity-selected sets (fMoE), if the predictor gives confidences."""
        tallies = [tally] if tally else self.tallies
        forecast = sum(t.forecast for t in tallies)
        size = sum(t.selected for t in tallies)
        if not size or not forecast:
            return None
        return size / forecast, sum(t.selected_hits for t in tallies) / max(1, sum(t.chosen for t in tallies))

    def to_json(self) -> dict[str, Any]:
        def row(t: LayerTally | None) -> dict[str, Any]:
            sel = self.selected(t)
            return {"coverage": self.coverage(t), **{f"recall@{k}": self.recall(k, t) for k in self.ks},
                    **{f"precision@{k}": self.precision(k, t) for k in self.ks},
                    **({"selected_size": sel[0], "selected_recall": sel[1]} if sel else {})}
        distance = "pass" if self.distance == PASS else self.distance
        return {"predictor": self.predictor, "distance": distance, "requests": self.requests,
                "tokens": self.tokens, "overall": row(None),
                "per_layer": {str(layer): row(t) for layer, t in zip(self.layers, self.tallies)}}


def _forecasts(predictor: Predictor, reader: TraceReader, requests: Sequence[int], distance: int,
               progress: Progress | None, prompt: int | None = None
               ) -> Iterator[tuple[TraceRequest, list[LayerObservation], Iterator[tuple[int, int, Forecast | None]]]]:
    """Per request (its tokens the rows of one iteration: a stateful predictor is told its prompt and its
    generated tokens as two rows, `prompt_length`): the request, its observations, and the forecasts the
    predictor makes at `distance` as (target layer, ahead, forecast), made as the layers are observed (PASS:
    every layer before any is observed). Consume each request's forecasts before asking for the next request."""
    h = reader.header

    def made(obs: list[LayerObservation]) -> Iterator[tuple[int, int, Forecast | None]]:
        if distance == PASS:
            for j in range(h.num_layers):
                yield j, 0, predictor.forecast(j, 0)
            return
        for i in range(h.num_layers):
            predictor.observe(i, obs[i])
            j, ahead = target_of(i, distance, h.num_layers)
            yield j, ahead, predictor.forecast(j, ahead)

    stateful = PREDICTORS[predictor.name].stateful
    for index in requests:
        request = reader.request(index)
        obs = observations(request, h)
        if stateful:
            p, n = prompt_length(request, prompt), request.num_tokens
            starts, counts, phases = zip(*[r for r in ((0, p, "prefill"), (p, n - p, "decode")) if r[1]])
            predictor.begin_rows([index] * len(starts), starts, counts, phases)
        predictor.start_iteration(row_token_ids(request), semantic_rows(request))
        yield request, obs, made(obs)
        if stateful:
            predictor.end_request(index)
        if progress is not None:
            progress(1)


def evaluate(predictor: Predictor, reader: TraceReader, requests: Sequence[int], distance: int,
             ks: Sequence[int], progress: Progress | None = None, prompt: int | None = None) -> PredictEval:
    h = reader.header
    ks = list(dict.fromkeys(ks))  # a cut-off asked for twice is counted once
    tallies = [LayerTally() for _ in range(h.num_layers)]
    tokens = 0
    for request, obs, made in _forecasts(predictor, reader, requests, distance, progress, prompt):
        tokens += request.num_tokens
        for j, ahead, forecast in made:
            _tally(tallies[j], forecast, obs[j].ids_NK, ahead, ks)
    return PredictEval(predictor.name, distance, list(ks),
                       list(h.moe_layers), tallies, len(requests), tokens)


def forecast_ranks(predictor: Predictor, reader: TraceReader, requests: Sequence[int], distance: int,
                   width: int, progress: Progress | None = None, prompt: int | None = None) -> np.ndarray:
    """For every token of `requests` (in order) and every layer, the `width` experts the predictor ranks first
    in the forecast it makes at `distance` (PASS: before the token's pass), int16, -1 where it makes none (a
    next-iteration target of a request's first token, or a predictor that cannot forecast it)."""
    h = reader.header
    out = []
    for request, _, made in _forecasts(predictor, reader, requests, distance, progress, prompt):
        ranks = np.full((request.num_tokens, h.num_layers, width), -1, np.int16)
        for j, ahead, forecast in made:
            _put(ranks[:, j], forecast, ahead, width)
        out.append(ranks)
    return np.concatenate(out) if out else np.zeros((0, h.num_layers, width), np.int16)


def replay_forecasts(predictor: Predictor, reader: TraceReader, requests: Sequence[int], request_N: np.ndarray,
                     prefetch_distance: int | None, progress: Progress | None = None) -> Forecasts:
    """What the simulator replays into a policy (`--forecast predictor`): for each token of `requests` (laid
    out as `request_N` numbers them), the forecast of its next token at every layer, made once the token's layer
    has routed (distance L; the predicted next use PLEC evicts by; 2K wide), and, with `prefetch_distance`, the
    forecast of the token itself made that many layers ahead (K wide; what prefetch loads)."""
    h = reader.header
    made = forecast_ranks(predictor, reader, requests, h.num_layers, 2 * h.top_k, progress)
    if (made < 0).all():
        raise PredictorError(f"{predictor.name} makes no forecast of a layer at the next token (distance "
                             f"{h.num_layers}); fit it for that distance (--distances ...,{h.num_layers})")
    following = np.full_like(made, -1)
    same = request_N[1:] == request_N[:-1]
    following[:-1][same] = made[1:][same]
    ahead = None
    if prefetch_distance is not None:
        ahead = forecast_ranks(predictor, reader, requests, prefetch_distance, h.top_k)
    return Forecasts(following, ahead)


def _put(ranks_TR: np.ndarray, forecast: Forecast | None, ahead: int, width: int) -> None:
    if forecast is None or len(ranks_TR) <= ahead:
        return
    top = forecast.top(width)[: len(ranks_TR) - ahead].numpy()
    ranks_TR[ahead:, : top.shape[1]] = top


def _tally(tally: LayerTally, forecast: Forecast | None, chosen_TK: torch.Tensor, ahead: int,
           ks: Sequence[int]) -> None:
    """Score forecasts for the target rows: the same rows (ahead 0) or the next ones (ahead 1)."""
    targets = chosen_TK[ahead:]
    tally.targets += len(targets)
    if forecast is None or not len(targets):
        return
    forecast = forecast.rows(slice(0, len(targets)))
    probs = forecast.probs_NE
    valid = targets >= 0
    tally.forecast += len(targets)
    tally.chosen += int(valid.sum())

    def hits(pred_TX: torch.Tensor, keep_TX: torch.Tensor | None = None) -> int:
        found_TXK = (pred_TX[:, :, None] == targets[:, None, :]) & valid[:, None, :]
        if keep_TX is not None:
            found_TXK &= keep_TX[:, :, None]
        return int(found_TXK.any(1).sum())

    for k in ks:
        tally.hits[k] = tally.hits.get(k, 0) + hits(torch.topk(probs, min(k, probs.shape[1]), dim=1).indices)
    if forecast.confidence_N is not None:
        order_TE, keep_TE = forecast.selection(targets.shape[1])
        tally.selected += int(keep_TE.sum())
        tally.selected_hits += hits(order_TE, keep_TE)


def format_eval(results: Sequence[PredictEval]) -> str:
    lines = ["predictor        distance  coverage  " + "  ".join(f"recall@{k:<3}" for k in results[0].ks) +
             "  fMoE-selected (size, recall)"]
    for r in results:
        recalls = "  ".join(f"{_pct(r.recall(k)):>9}" for k in r.ks)
        sel = r.selected()
        lines.append(f"{r.predictor:<16} {distance_label(r.distance):>8}  {_pct(r.coverage()):>8}  {recalls}  "
                     + (f"{sel[0]:.1f}, {_pct(sel[1])}" if sel else "-"))
    return "\n".join(lines)


def distance_label(distance: int) -> str:
    return "pass" if distance == PASS else str(distance)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
