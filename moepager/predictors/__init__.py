"""Routing predictors, one file each, and their registry.

| name | needs | learns from |
|---|---|---|
| transition | expert ids | transition tables fitted on a trace (`moepager predictor fit`) |
| expert-map | gate distributions (+ semantic embedding) | a map store fitted on a trace, and/or online |
| gate-lookahead | the model's routers and hidden states | nothing (uses the next layers' routers) |
| token-wise | hidden states | per-layer gate-shaped predictors trained on a trace recorded with hidden states |
"""

from __future__ import annotations

from pathlib import Path

import torch

from moepager.predictors.base import Forecast, LayerObservation, Predictor, PredictorError, k_hot, target_of
from moepager.predictors.expert_map import ExpertMapPredictor, ExpertMapStore
from moepager.predictors.gate_lookahead import GateLookaheadPredictor, RouterScores
from moepager.predictors.token_wise import TokenWisePredictor
from moepager.predictors.transition import TransitionPredictor

PREDICTORS = ["transition", "expert-map", "gate-lookahead", "token-wise"]
FITTED = ["transition", "expert-map", "token-wise"]
"""Predictors whose learned state lives in a file written by `moepager predictor fit`."""
ONLINE = ["expert-map"]
"""Predictors that can learn while the engine runs (`--learn-maps`)."""
DEFAULT_DISTANCE = {"transition": 1, "expert-map": 3, "gate-lookahead": 1}
"""Prefetch distance in MoE layers when none is given; token-wise predicts one token ahead (distance L)."""


def default_distance(name: str, num_layers: int) -> int:
    return min(DEFAULT_DISTANCE.get(name, num_layers), num_layers)


def load_state(path: str | Path, kind: str) -> dict:
    """A predictor file's contents, checked to be of `kind`."""
    p = Path(path)
    if not p.is_file():
        raise PredictorError(f"predictor file {p} does not exist (write one with `moepager predictor fit`)")
    try:
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
    if name not in PREDICTORS:
        raise PredictorError(f"unknown predictor '{name}'; choose from {', '.join(PREDICTORS)}")
    if name == "gate-lookahead":
        if routers is None:
            raise PredictorError("gate-lookahead needs the model's routers: run it in the engine or give --model")
        return GateLookaheadPredictor(routers)
    if name == "expert-map":
        store = ExpertMapStore.from_state(load_state(file, name)) if file else None
        if store is None:
            if not learn:
                raise PredictorError("expert-map needs a map store file (--predictor-file) or online learning")
            store = ExpertMapStore(num_layers, num_experts, "embedding", distance=distance)
        _check(name, (store.num_layers, store.num_experts), (num_layers, num_experts))
        return ExpertMapPredictor(store, learn=learn)
    if file is None:
        raise PredictorError(f"{name} needs a fitted predictor file (`moepager predictor fit --kind {name}`)")
    state = load_state(file, name)
    if name == "transition":
        transition = TransitionPredictor.from_state(state)
        _check(name, (transition.num_layers, transition.num_experts), (num_layers, num_experts))
        if distance not in transition.distances:
            raise PredictorError(f"the transition tables in {file} were fitted for distances "
                                 f"{sorted(transition.distances)}, not {distance}; refit with --distances")
        return transition
    token_wise = TokenWisePredictor.from_state(state)
    _check(name, tuple(token_wise.weights_LED.shape[:2]), (num_layers, num_experts))
    return token_wise


def _check(name: str, got: tuple[int, ...], want: tuple[int, int]) -> None:
    if tuple(got) != want:
        raise PredictorError(f"the {name} predictor is for {got[0]} MoE layers x {got[1]} experts; this model has "
                             f"{want[0]} x {want[1]}")


__all__ = ["DEFAULT_DISTANCE", "FITTED", "ONLINE", "PREDICTORS", "ExpertMapPredictor", "ExpertMapStore", "Forecast",
           "GateLookaheadPredictor", "LayerObservation", "Predictor", "PredictorError", "TokenWisePredictor",
           "TransitionPredictor", "default_distance", "k_hot", "load_state", "make_predictor", "target_of"]
