"""SMoE's token-wise predictor (Zhang et al., "SMoE: Efficient MoE Inference on a Single GPU with Dynamic Expert
Caching", token-wise prefetching; seed digest smoe.md §2.6).

One predictor per MoE layer, shaped like that layer's gate (a linear map to expert scores): from the current
token's router input x_l(t) it scores the experts the *next* token will choose at the same layer l. The
prediction is ready a whole forward pass before it is needed. The weights are trained offline (a softmax
regression, so starting from zero is fine) on pairs (x_l(t), experts_l(t+1)) from traces recorded with hidden
states (`moepager predictor fit --kind token-wise`); a few hundred tokens suffice (SMoE uses 20 samples from 5
datasets).
Shape legend: N rows, D hidden, E experts, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moepager.predictors.base import Forecast, LayerObservation


@dataclass(frozen=True)
class TokenWiseFit:
    """What `moepager predictor fit --kind ...` takes for this predictor (trace/fit.py fits it)."""

    epochs: int = 200
    """Full-batch Adam epochs."""



class TokenWisePredictor:

    name = "token-wise"
    semantic = None
    needs_scores = False
    hidden = "host"

    def __init__(self, weights_LED: torch.Tensor):
        self.weights_LED = weights_LED.float()
        self._x: dict[int, torch.Tensor] = {}

    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        self._x = {}

    def observe(self, layer: int, obs: LayerObservation) -> None:
        if obs.x_ND is not None:
            self._x[layer] = obs.x_ND

    @torch.no_grad()
    def forecast(self, layer: int, ahead: int) -> Forecast | None:
        """Only the next token's layers this iteration has already passed (it predicts one token ahead)."""
        x_ND = self._x.get(layer)
        if ahead != 1 or x_ND is None:
            return None
        return Forecast(torch.softmax(x_ND.float() @ self.weights_LED[layer].T, dim=1))

    def save(self, path: str | Path) -> None:
        torch.save({"kind": self.name, "weights": self.weights_LED}, path)

    @classmethod
    def from_state(cls, state: dict) -> TokenWisePredictor:
        return cls(state["weights"])


def train_token_wise(x_NLD: torch.Tensor, ids_NLK: torch.Tensor, next_N: torch.Tensor, init_LED: torch.Tensor,
                     epochs: int = 200, lr: float = 1e-2, weight_decay: float = 1e-4,
                     progress: Callable[[int, float], None] | None = None) -> TokenWisePredictor:
    """Fit each layer's gate-shaped predictor: token n's router input -> token next_N[n]'s experts.

    `next_N[n]` is the index of the token after n in the same request (-1 for a request's last token). The
    loss is cross-entropy against the next token's top-k set (1/K on each chosen expert), full batch, Adam.
    """
    have_next = next_N >= 0
    x = x_NLD[have_next].float()
    targets = ids_NLK[next_N[have_next]].long()
    weights = init_LED.float().clone().requires_grad_(True)
    opt = torch.optim.Adam([weights], lr=lr, weight_decay=weight_decay)
    num_experts = init_LED.shape[1]
    target_NLE = torch.zeros(x.shape[0], x.shape[1], num_experts).scatter_(2, targets.clamp(min=0), 1.0)
    target_NLE = target_NLE / target_NLE.sum(2, keepdim=True).clamp(min=1)
    for epoch in range(epochs):
        logits_NLE = torch.einsum("nld,led->nle", x, weights)
        loss = -(target_NLE * F.log_softmax(logits_NLE, dim=2)).sum(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if progress is not None:
            progress(epoch, loss.item())
    return TokenWisePredictor(weights.detach())
