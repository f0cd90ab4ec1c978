"""Fitting the learned predictors on a trace's requests, each predictor with a fit configuration of its own.

`FITTERS` maps every fitted predictor (predictors.PREDICTORS with a `fit_config`) to its `Fitter`: the configuration
it takes (the options `moepager predictor fit` accepts for it, and nothing else), how it fits, and what its progress
counts. Shape legend: N rows, L MoE layers, K top-k, E experts, D hidden.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from moepager.predictors import (
    ExpertMapFit,
    ExpertMapPredictor,
    ExpertMapStore,
    HeadFit,
    PathFit,
    Predictor,
    PredictorError,
    TokenWiseFit,
    TokenWisePredictor,
    TransitionFit,
    TransitionPredictor,
    head,
    path,
)
from moepager.predictors.expert_map import DEFAULT_CAPACITY, HASH_DIM
from moepager.predictors.token_wise import train_token_wise
from moepager.trace.format import TraceReader, TraceRequest
from moepager.trace.predict import (
    Progress,
    evaluate,
    observations,
    prompt_length,
    row_token_ids,
    semantic_rows,
    split_requests,
)


def stacked(reader: TraceReader, train: Sequence[int]) -> tuple[list[TraceRequest], torch.Tensor, torch.Tensor]:
    """The training requests, their ids_NLK one after another, and which request each row is (request_N)."""
    requests = [reader.request(i) for i in train]
    ids = torch.from_numpy(np.concatenate([r.ids_TLK for r in requests]).astype(np.int64))
    request_N = torch.from_numpy(np.repeat(np.arange(len(requests)), [r.num_tokens for r in requests]))
    return requests, ids, request_N


def fit_transition(reader: TraceReader, train: Sequence[int], distances: Sequence[int], sources: int = 1,
                   alpha: float = 8.0) -> TransitionPredictor:
    """Tables for `distances` and, with several sources, the older layers' distances too (d + 1, d + 2, ...)."""
    _, ids, request_N = stacked(reader, train)
    num_layers = reader.header.num_layers
    wanted = sorted({d + extra for d in distances for extra in range(sources) if d + extra <= num_layers})
    fitted = TransitionPredictor.fit(ids, request_N, reader.header.num_experts, wanted)
    fitted.alpha, fitted.sources = alpha, sources
    return fitted


def fit_expert_maps(reader: TraceReader, train: Sequence[int], capacity: int = DEFAULT_CAPACITY,
                    distance: int = 3, max_iterations: int = 20_000, seed: int = 0,
                    progress: Progress | None = None, neighbours: int = 1,
                    trajectory_only: bool = False) -> ExpertMapStore:
    """fMoE's offline store: iterations of the training requests (a seeded sample of at most
    `max_iterations`) inserted with redundancy-based replacement. Requests without token ids or strings get a
    zero semantic embedding (the semantic search then cannot forecast for them); `trajectory_only` stores none
    (semantic kind "none")."""
    h = reader.header
    total = sum(reader.request(i).num_tokens for i in train) if len(train) else 0
    keep = min(1.0, max_iterations / max(total, 1))
    rng = np.random.default_rng(seed)
    store = ExpertMapStore(h.num_layers, h.num_experts, "none" if trajectory_only else "hashed-tokens", capacity,
                           distance, neighbours)
    for i in train:
        request = reader.request(i)
        sem = None if trajectory_only else semantic_rows(request)
        if sem is None:
            sem = torch.zeros(request.num_tokens, HASH_DIM)
        rows = np.flatnonzero(rng.random(request.num_tokens) < keep)
        maps = torch.stack([o.probs_NE for o in observations(request, h)], 1)
        store.add(sem[rows], maps[rows])
        if progress is not None:
            progress(1)
    return store


def fit_token_wise(reader: TraceReader, train: Sequence[int], epochs: int = 200,
                   progress: Callable[[int, float], None] | None = None) -> TokenWisePredictor:
    requests = [reader.request(i) for i in train]
    if any(r.hidden_TLD is None for r in requests):
        raise PredictorError(f"{reader.path} has no hidden states; record one with "
                             "`moepager generate --record-trace PATH --record-hidden`")
    x = torch.from_numpy(np.concatenate([r.hidden_TLD for r in requests]).astype(np.float32))
    ids = torch.from_numpy(np.concatenate([r.ids_TLK for r in requests]).astype(np.int64))
    lengths = [r.num_tokens for r in requests]
    nxt = np.arange(1, sum(lengths) + 1)
    nxt[np.cumsum(lengths) - 1] = -1
    init = torch.zeros(reader.header.num_layers, reader.header.num_experts, x.shape[2])
    return train_token_wise(x, ids, torch.from_numpy(nxt), init, epochs=epochs, progress=progress)



@dataclass(frozen=True)
class Fitter:
    """How a fitted predictor learns from a trace's requests."""

    config: type[Any]
    """Its fit configuration (one of FitConfig's classes)."""
    fit: Callable[[TraceReader, Sequence[int], Any, Progress], Predictor]
    """(reader, training requests, configuration, progress(advance)) -> the predictor."""
    unit: str
    """What the progress counts."""
    total: Callable[[Sequence[int], Any], int | None]
    """What the progress will count to (None: not known before the fit starts)."""

    def configure(self, kind: str, **given: Any) -> Any:
        """Its configuration from `given` (field -> value; None keeps the default), refusing a field it has not."""
        names = {f.name for f in fields(self.config)}
        foreign = sorted(k for k, v in given.items() if v is not None and k not in names)
        if foreign:
            raise PredictorError(f"{kind} takes no {', '.join(foreign)} (its fit options: {', '.join(sorted(names))})")
        return self.config(**{k: v for k, v in given.items() if v is not None})

    def applicable(self, **settings: Any) -> Any:
        """Its configuration from those of `settings` its configuration has (the rest do not apply to it): for tools
        that fit several kinds alike (predict-eval, benchmarks)."""
        names = {f.name for f in fields(self.config)}
        return self.config(**{k: v for k, v in settings.items() if k in names and v is not None})


def _fit_transition(reader: TraceReader, train: Sequence[int], c: TransitionFit, progress: Progress) -> Predictor:
    fitted = fit_transition(reader, train, c.distances, c.sources, c.alpha)
    progress(1)
    return fitted


def _fit_expert_maps(reader: TraceReader, train: Sequence[int], c: ExpertMapFit, progress: Progress) -> Predictor:
    return ExpertMapPredictor(fit_expert_maps(reader, train, c.capacity, c.distance, c.max_iterations, c.seed,
                                              progress, c.neighbours, c.trajectory_only))


def _fit_token_wise(reader: TraceReader, train: Sequence[int], c: TokenWiseFit, progress: Progress) -> Predictor:
    return fit_token_wise(reader, train, c.epochs, progress=lambda epoch, loss: progress(1))


def fit_head(reader: TraceReader, train: Sequence[int], c: HeadFit, progress: Progress) -> Predictor:
    """The learned head for every fitted distance and the pass (distance 0, when the trace has tokens). Its shape
    (linear, or with head.DEFAULT_HIDDEN hidden units) is `c.hidden`, or, when None, the one whose heads fitted on
    all but `c.holdout` of the training requests forecast the held-out ones better (recall at the trace's top-k,
    averaged over the fitted distances; a tie goes to the linear head, the cheaper), refitted on every request."""
    if c.hidden is not None:
        return _fit_head_shape(reader, train, c, c.hidden, progress)
    if len(train) < 2:
        print("head: linear (one training request leaves none to hold out and choose the shape by)", file=sys.stderr)
        return _fit_head_shape(reader, train, c, 0, progress)
    picked, held = split_requests(len(train), c.holdout, c.seed)
    fit_on, held_out = [train[i] for i in picked], [train[i] for i in held]
    k = reader.header.top_k
    recall = {}
    for hidden in (0, head.DEFAULT_HIDDEN):
        candidate = _fit_head_shape(reader, fit_on, c, hidden, progress)
        recall[hidden] = sum(evaluate(candidate, reader, held_out, d, [k]).recall(k) for d in c.distances) \
            / len(c.distances)
    chosen = max(recall, key=lambda h: (recall[h], -h))
    shape = {0: "linear", head.DEFAULT_HIDDEN: f"an MLP of {head.DEFAULT_HIDDEN} hidden units"}
    print(f"head: {shape[chosen]}, which forecast {len(held_out)} held-out requests better (recall@{k} "
          + ", ".join(f"{shape[h].split(' of')[0]} {recall[h]:.3f}" for h in recall) + ")", file=sys.stderr)
    return _fit_head_shape(reader, train, c, chosen, progress)


def _fit_head_shape(reader: TraceReader, train: Sequence[int], c: HeadFit, hidden: int,
                    progress: Progress) -> Predictor:
    requests, ids, request_N = stacked(reader, train)
    tokens = [row_token_ids(r) for r in requests]
    have_tokens = c.tokens and all(len(t) == r.num_tokens for t, r in zip(tokens, requests)) and len(requests) > 0
    return head.fit_head(ids, request_N, reader.header.num_experts, (0, *c.distances),
                         torch.cat(tokens).tolist() if have_tokens else None, epochs=c.epochs,
                         hidden=hidden, seed=c.seed, progress=progress, steps=c.steps)


def fit_path(reader: TraceReader, train: Sequence[int], c: PathFit, progress: Progress) -> Predictor:
    requests = [reader.request(i) for i in train]
    tokens = [row_token_ids(r) for r in requests]
    if any(len(t) != r.num_tokens for t, r in zip(tokens, requests)):
        raise PredictorError(f"the path predictor reads tokens, and {reader.path} has requests without token ids "
                             f"or strings")
    return path.fit_path([t.tolist() for t in tokens], [torch.from_numpy(r.ids_TLK.astype(np.int64))
                                                       for r in requests], reader.header.num_experts,
                         path.SHAPES[c.shape], c.epochs, seed=c.seed, resume=c.resume, progress=progress,
                         prompts=[prompt_length(r, c.prompt) for r in requests])


FITTERS: dict[str, Fitter] = {
    "transition": Fitter(TransitionFit, _fit_transition, "fit", lambda train, c: 1),
    "expert-map": Fitter(ExpertMapFit, _fit_expert_maps, "request", lambda train, c: len(train)),
    "token-wise": Fitter(TokenWiseFit, _fit_token_wise, "epoch", lambda train, c: c.epochs),
    "head": Fitter(HeadFit, fit_head, "pass", lambda train, c: None),
    "path": Fitter(PathFit, fit_path, "epoch", lambda train, c: c.epochs),
}
"""Every fitted predictor's fitting, by registry name (its configuration class is the one its registry entry names:
tests/trace/test_predict.py checks they agree)."""
