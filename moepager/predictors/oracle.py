"""The replay oracle: during a routing replay, forecast exactly what the trace recorded.

Not a predictor a deployment can run (it reads the future from the trace being replayed), but the upper bound
every real predictor is measured against: with it, prefetching is as accurate as prefetching can be, so what
is left of the load time at a budget is the disk's and the compute's, not the forecast's. It answers issue 15's
"if the predictor target does not hold, show where the time goes". The engine binds it to the replayer for the
length of `LLM.replay` (`bind`); outside a replay it has nothing to read and `LLM.generate` refuses it.
Shape legend: N rows, K top-k, E experts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moepager.predictors.base import Forecast, LayerObservation, k_hot


class RecordedRouting(Protocol):
    def recorded(self, column: int, ahead: int) -> torch.Tensor:
        """ids_NK recorded at MoE layer `column` for this pass's rows (`ahead` 0) or the token after each (1);
        negative where nothing was recorded."""
        ...


class ReplayOracle:

    name = "replay-oracle"
    semantic = None
    needs_scores = False
    hidden = None

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.source: RecordedRouting | None = None

    def bind(self, source: RecordedRouting | None) -> None:
        """Read forecasts from `source` (a replay's recorded routing); None unbinds."""
        self.source = source

    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        return None

    def observe(self, layer: int, obs: LayerObservation) -> None:
        return None

    def forecast(self, layer: int, ahead: int) -> Forecast | None:
        if self.source is None:
            return None
        # probability 1 for each recorded expert (it will be used): a probability floor (--prefetch-min-p) keeps
        # them all, where k_hot's 1/K per expert fell below any floor above 1/K
        return Forecast((k_hot(self.source.recorded(layer, ahead).cpu(), self.num_experts) > 0).float())
