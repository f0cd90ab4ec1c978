"""Statistical baseline: per-layer transition tables learned from traces.

For a prefetch distance d and every MoE layer i, a table counts how often expert e at layer i was followed by
expert e' at the target (layer i + d of the same token, or layer i + d - L of the next token of the same
request). The forecast sums the rows of the experts just chosen at the last observed layer (add-one
smoothed, normalised). Needs only expert ids, so it works on every trace, including the public ones that
carry no gate scores or hidden states.
Shape legend: N tokens, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from moepager.predictors.base import Forecast, LayerObservation, target_of


class TransitionPredictor:

    name = "transition"
    semantic = None
    needs_scores = False
    hidden = None

    def __init__(self, tables: dict[tuple[int, int, int], torch.Tensor], num_layers: int, num_experts: int):
        self.tables = tables
        """(source layer, target layer, ahead) -> probs_EE, rows normalised."""
        self.num_layers, self.num_experts = num_layers, num_experts
        self._seen: list[tuple[int, torch.Tensor]] = []

    @classmethod
    def fit(cls, ids_NLK: torch.Tensor, request_N: torch.Tensor, num_experts: int,
            distances: Iterable[int]) -> TransitionPredictor:
        """Count transitions over N tokens of several requests (rows in order within each request)."""
        n, num_layers, k = ids_NLK.shape
        ids = ids_NLK.long()
        same_next = torch.zeros(n, dtype=torch.bool)
        same_next[:-1] = request_N[1:] == request_N[:-1]
        tables = {}
        for d in distances:
            for i in range(num_layers):
                j, ahead = target_of(i, d, num_layers)
                src, dst = (ids[:, i], ids[:, j]) if not ahead else (ids[:-1, i][same_next[:-1]],
                                                                     ids[1:, j][same_next[:-1]])
                pairs_NKK = src[:, :, None] * num_experts + dst[:, None, :]
                valid = (src[:, :, None] >= 0) & (dst[:, None, :] >= 0)
                counts = torch.bincount(pairs_NKK[valid], minlength=num_experts * num_experts).double()
                counts = counts.reshape(num_experts, num_experts) + 1.0
                tables[(i, j, ahead)] = (counts / counts.sum(1, keepdim=True)).float()
        return cls(tables, num_layers, num_experts)

    @property
    def distances(self) -> set[int]:
        """The prefetch distances the tables were fitted for."""
        return {j - i if not ahead else self.num_layers - i + j for i, j, ahead in self.tables}

    def save(self, path: str | Path) -> None:
        torch.save({"kind": self.name, "num_layers": self.num_layers, "num_experts": self.num_experts,
                    "tables": {f"{i},{j},{a}": t for (i, j, a), t in self.tables.items()}}, path)

    @classmethod
    def from_state(cls, state: dict) -> TransitionPredictor:
        tables = {tuple(int(x) for x in key.split(",")): t for key, t in state["tables"].items()}
        return cls(tables, state["num_layers"], state["num_experts"])  # type: ignore[arg-type]

    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        self._seen = []

    def observe(self, layer: int, obs: LayerObservation) -> None:
        self._seen.append((layer, obs.ids_NK))

    def forecast(self, layer: int, ahead: int) -> Forecast | None:
        """From the most recent observed layer that has a table for this target."""
        for source, ids_NK in reversed(self._seen):
            table = self.tables.get((source, layer, ahead))
            if table is not None:
                valid = (ids_NK >= 0).float()
                rows_NKE = table[ids_NK.clamp(min=0).long()] * valid[..., None]
                probs_NE = rows_NKE.sum(1)
                return Forecast(probs_NE / probs_NE.sum(1, keepdim=True).clamp(min=1e-12))
        return None

