"""Routing predictors, one file each, and their registry.

| name | needs | learns from |
|---|---|---|
| transition | expert ids | transition tables fitted on a trace (`moepager predictor fit`) |
| expert-map | gate distributions (+ semantic embedding) | a map store fitted on a trace, and/or online |
| gate-lookahead | the model's routers and hidden states | nothing (uses the next layers' routers) |
| token-wise | hidden states | per-layer gate-shaped predictors trained on a trace recorded with hidden states |
| head | expert ids (+ token ids) | a logistic head per layer over the last layers' experts and the token (fitted) |
| path | token ids | ExpertFlow's routing path predictor: a small causal transformer, every layer before the pass |
| replay-oracle | a routing replay | nothing: it reads the replayed trace (a perfect predictor's upper bound) |
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moepager.predictors.base import (
    Forecast,
    LayerObservation,
    Predictor,
    PredictorError,
    k_hot,
    target_of,
    token_keys,
)
from moepager.predictors.expert_map import ExpertMapFit, ExpertMapPredictor, ExpertMapStore
from moepager.predictors.gate_lookahead import GateLookaheadPredictor, RouterScores
from moepager.predictors.head import HeadFit, HeadPredictor
from moepager.predictors.oracle import RecordedRouting, ReplayOracle
from moepager.predictors.path import PathFit, PathPredictor
from moepager.predictors.token_wise import TokenWiseFit, TokenWisePredictor
from moepager.predictors.transition import TransitionFit, TransitionPredictor


@dataclass(frozen=True)
class BuildContext:
    """What building a predictor for a model may use."""

    num_layers: int
    num_experts: int
    file: str | Path | None = None
    """The fitted state (`moepager predictor fit`)."""
    routers: list[RouterScores] | None = None
    """The model's routers in MoE-layer order (gate lookahead applies them)."""
    learn: bool = False
    """Learn online while the engine runs (expert-map)."""
    distance: int = 3
    """The prefetch distance the predictor will be asked for."""


@dataclass(frozen=True)
class PredictorSpec:
    """A registered predictor: how to build it, how it is fitted, and what it needs (the same shape as POLICIES and
    CONVERTERS). The fitting itself reads traces, so it lives beside the trace reader (trace/fit.py FITTERS)."""

    build: Callable[[BuildContext], Predictor]
    fit_config: type | None
    """Its fit configuration (what `moepager predictor fit` takes for it); None: nothing to fit."""
    online: bool = False
    """It can learn while the engine runs (`--learn-maps`)."""
    default_distance: int | None = None
    """Prefetch distance in MoE layers when none is given; None: one token ahead (all L layers)."""
    default_per_row: int | None = None
    """Experts prefetched per forecast row when --prefetch-k is not given; None: the model's top-k."""
    default_min_p: float = 0.0
    """The probability floor of what is prefetched when --prefetch-min-p is not given."""
    needs_routers: bool = False
    replay_only: bool = False
    """It forecasts from the routing being replayed (`bind` to the replayer): only `LLM.replay` runs it."""
    stateful: bool = False
    """It keeps state per request (the path predictor's): the engine tells it the rows' requests (`begin_rows`) and
    when a request ends (`end_request`)."""


def _gate_lookahead(ctx: BuildContext) -> Predictor:
    if ctx.routers is None:
        raise PredictorError("gate-lookahead needs the model's routers: run it in the engine or give --model")
    return GateLookaheadPredictor(ctx.routers)


def _expert_map(ctx: BuildContext) -> Predictor:
    store = ExpertMapStore.from_state(load_state(ctx.file, "expert-map")) if ctx.file else None
    if store is None:
        if not ctx.learn:
            raise PredictorError("expert-map needs a map store file (--predictor-file) or online learning")
        store = ExpertMapStore(ctx.num_layers, ctx.num_experts, "embedding", distance=ctx.distance)
    _check("expert-map", (store.num_layers, store.num_experts), (ctx.num_layers, ctx.num_experts))
    return ExpertMapPredictor(store, learn=ctx.learn)


def _transition(ctx: BuildContext) -> Predictor:
    transition = TransitionPredictor.from_state(_fitted_state(ctx, "transition"))
    _check("transition", (transition.num_layers, transition.num_experts), (ctx.num_layers, ctx.num_experts))
    _check_distance("transition tables", transition.distances, ctx)
    return transition


def _head(ctx: BuildContext) -> Predictor:
    head = HeadPredictor.from_state(_fitted_state(ctx, "head"))
    _check("head", (head.num_layers, head.num_experts), (ctx.num_layers, ctx.num_experts))
    _check_distance("heads", head.distances - {0}, ctx)
    return head


def _path(ctx: BuildContext) -> Predictor:
    path = PathPredictor.from_state(_fitted_state(ctx, "path"))
    _check("path", (path.num_layers, path.num_experts), (ctx.num_layers, ctx.num_experts))
    return path


def _token_wise(ctx: BuildContext) -> Predictor:
    token_wise = TokenWisePredictor.from_state(_fitted_state(ctx, "token-wise"))
    _check("token-wise", tuple(token_wise.weights_LED.shape[:2]), (ctx.num_layers, ctx.num_experts))
    return token_wise


PREDICTORS: dict[str, PredictorSpec] = {
    "transition": PredictorSpec(_transition, TransitionFit, default_distance=1),
    "expert-map": PredictorSpec(_expert_map, ExpertMapFit, online=True, default_distance=3),
    "gate-lookahead": PredictorSpec(_gate_lookahead, None, default_distance=1, needs_routers=True),
    "token-wise": PredictorSpec(_token_wise, TokenWiseFit),
    # one expert a row, those more likely than not: on replayed DeepSeek-V2-Lite routing at 25% the paired runs put
    # PLEC + the MLP head at 1.14x LRU over sixteen rounds (k2 1.13x; every expert of top-6 at floor 0.7 0.88-0.93x:
    # README)
    "head": PredictorSpec(_head, HeadFit, default_distance=1, default_per_row=1, default_min_p=0.5),
    "path": PredictorSpec(_path, PathFit, stateful=True),
    "replay-oracle": PredictorSpec(lambda ctx: ReplayOracle(ctx.num_experts), None, default_distance=1,
                                   replay_only=True),
}
FITTED = [name for name, spec in PREDICTORS.items() if spec.fit_config is not None]
"""Predictors whose learned state lives in a file written by `moepager predictor fit`."""
ONLINE = [name for name, spec in PREDICTORS.items() if spec.online]
"""Predictors that can learn while the engine runs (`--learn-maps`)."""


def bind_replay(predictor: Predictor, source: RecordedRouting | None) -> None:
    """Point a replay-only predictor at the routing being replayed (None: the replay ended); others ignore it."""
    if isinstance(predictor, ReplayOracle):
        predictor.bind(source)


def default_distance(name: str, num_layers: int) -> int:
    return min(PREDICTORS[name].default_distance or num_layers, num_layers)


def load_state(path: str | Path, kind: str) -> dict:
    """A predictor file's contents, checked to be of `kind`."""
    p = Path(path)
    if not p.is_file():
        raise PredictorError(f"predictor file {p} does not exist (write one with `moepager predictor fit`)")
    try:
        with warnings.catch_warnings():  # torch warns about a garbage file's pickle protocol before failing on it
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(p, weights_only=True)
    except Exception as e:  # torch raises several unrelated types for corrupt files
        raise PredictorError(f"{p} is not a moepager predictor file ({type(e).__name__}: it cannot be read as "
                             f"one; write one with `moepager predictor fit`)") from None
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise PredictorError(f"{p} holds a '{found}' predictor, not '{kind}'")
    return state


def make_predictor(name: str, *, num_layers: int, num_experts: int, file: str | Path | None = None,
                   routers: list[RouterScores] | None = None, learn: bool = False, distance: int = 3) -> Predictor:
    """Build a registered predictor and check it fits the model's geometry (layers x experts)."""
    spec = PREDICTORS.get(name)
    if spec is None:
        raise PredictorError(f"unknown predictor '{name}'; choose from {', '.join(PREDICTORS)}")
    return spec.build(BuildContext(num_layers, num_experts, file, routers, learn, distance))


def _fitted_state(ctx: BuildContext, name: str) -> dict:
    if ctx.file is None:
        raise PredictorError(f"{name} needs a fitted predictor file (`moepager predictor fit --kind {name}`)")
    return load_state(ctx.file, name)


def _check_distance(what: str, fitted: set[int], ctx: BuildContext) -> None:
    if ctx.distance not in fitted:
        raise PredictorError(f"the {what} in {ctx.file} were fitted for distances {sorted(fitted)}, not "
                             f"{ctx.distance}; refit with --distances")


def _check(name: str, got: tuple[int, ...], want: tuple[int, int]) -> None:
    if tuple(got) != want:
        raise PredictorError(f"the {name} predictor is for {got[0]} MoE layers x {got[1]} experts; this model has "
                             f"{want[0]} x {want[1]}")


__all__ = ["BuildContext", "FITTED", "PredictorSpec", "ONLINE", "PREDICTORS", "ExpertMapPredictor", "ExpertMapStore",
           "Forecast", "GateLookaheadPredictor", "HeadPredictor", "LayerObservation", "PathPredictor", "Predictor",
           "PredictorError", "RecordedRouting", "TokenWisePredictor", "TransitionPredictor", "default_distance",
           "k_hot", "load_state", "make_predictor", "target_of", "token_keys"]
