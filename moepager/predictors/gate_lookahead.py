"""Gate lookahead (MoEpic §3.2 eq. 3, after AdapMoE and Mixtral-offloading's speculative prefetch).

Residual connections keep hidden states similar from layer to layer, so the router input x_i of MoE layer i,
fed to the router of layer j > i, approximates layer j's routing: forecast = router_j(x_i). For the next
token's layers (j <= i, `ahead` 1) the current token's latest router input stands in for the next token's
(MoEpic uses the last layer's state for the next token's first layer). Needs the model's routers and the
hidden states, so it runs in the engine (and on traces recorded with --record-hidden).
Shape legend: N rows, D hidden, E experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moepager.predictors.base import Forecast, LayerObservation

RouterScores = Callable[[torch.Tensor], torch.Tensor]
"""x_ND -> the router's scores over experts, scores_NE (softmax probabilities or sigmoid affinities)."""


class GateLookaheadPredictor:

    name = "gate-lookahead"
    semantic = None
    needs_scores = False
    hidden = "device"

    def __init__(self, routers: Sequence[RouterScores]):
        self.routers = list(routers)
        """One per MoE layer, in order."""
        self._x_ND: torch.Tensor | None = None

    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        self._x_ND = None

    def observe(self, layer: int, obs: LayerObservation) -> None:
        self._x_ND = obs.x_ND

    @torch.no_grad()
    def forecast(self, layer: int, ahead: int) -> Forecast | None:
        if self._x_ND is None:
            return None
        scores_NE = self.routers[layer](self._x_ND).float()
        return Forecast(scores_NE / scores_NE.sum(1, keepdim=True).clamp(min=1e-12))
