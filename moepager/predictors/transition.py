"""Statistical baseline: per-layer transition tables learned from traces.

For a prefetch distance d and every MoE layer i, a table counts how often expert e at layer i was followed by
expert e' at the target (layer i + d of the same token, or layer i + d - L of the next token of the same
request). The forecast sums, over the experts just chosen at the last observed layer, the rows backed off to
the target layer's own frequencies (Katz-style, for rare sources):
    P(e' | e) = (C[e, e'] + alpha * f(e')) / (n(e) + alpha),  f = the target's normalised frequencies,
so a source seen a handful of times says little and one seen thousands of times speaks for itself (alpha = the
back-off mass in counts, default 8). With `sources` > 1 the last `sources` observed layers each forecast the
target from their own table (distances d, d+1, ...), combined by weights halving with age. One source is the
co-occurrence-with-back-off baseline every better predictor is measured against.
Needs only expert ids, so it works on every trace, including the public ones that carry no gate scores or
hidden states.
Shape legend: N tokens, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from moepager.predictors.base import Forecast, LayerObservation, PredictorError, target_of


@dataclass(frozen=True)
class TransitionFit:
    """What `moepager predictor fit --kind ...` takes for this predictor (trace/fit.py fits it)."""

    distances: tuple[int, ...] = (1, 2, 3)
    """Prefetch distances to fit tables for."""
    sources: int = 1
    """Observed layers combined per forecast (1: the co-occurrence-with-back-off baseline)."""
    alpha: float = 8.0
    """Back-off mass (counts) towards the target layer's frequencies."""



class TransitionPredictor:

    name = "transition"
    semantic = None
    needs_scores = False
    hidden = None

    def __init__(self, tables: dict[tuple[int, int, int], torch.Tensor], num_layers: int, num_experts: int,
                 alpha: float = 8.0, sources: int = 1):
        self.tables = tables
        """(source layer, target layer, ahead) -> counts_EE (source expert row, target expert column)."""
        self.num_layers, self.num_experts = num_layers, num_experts
        self.alpha, self.sources = alpha, sources
        self._backed: dict[tuple[int, int, int], torch.Tensor] = {}
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
                counts = torch.bincount(pairs_NKK[valid], minlength=num_experts * num_experts).float()
                tables[(i, j, ahead)] = counts.reshape(num_experts, num_experts)
        return cls(tables, num_layers, num_experts)

    @property
    def distances(self) -> set[int]:
        """The prefetch distances the tables were fitted for."""
        return {j - i if not ahead else self.num_layers - i + j for i, j, ahead in self.tables}

    def save(self, path: str | Path) -> None:
        torch.save({"kind": self.name, "version": 2, "num_layers": self.num_layers, "num_experts": self.num_experts,
                    "alpha": self.alpha, "sources": self.sources,
                    "tables": {f"{i},{j},{a}": t for (i, j, a), t in self.tables.items()}}, path)

    @classmethod
    def from_state(cls, state: dict) -> TransitionPredictor:
        if state.get("version") != 2:
            raise PredictorError("this transition file holds smoothed tables from an older moepager, not counts; "
                                 "refit it with `moepager predictor fit --kind transition`")
        tables = {tuple(int(x) for x in key.split(",")): t for key, t in state["tables"].items()}
        return cls(tables, state["num_layers"], state["num_experts"], state["alpha"],  # type: ignore[arg-type]
                   state["sources"])

    def backed_off(self, key: tuple[int, int, int]) -> torch.Tensor | None:
        """The table of `key` as P(target expert | source expert), backed off to the target's frequencies."""
        probs = self._backed.get(key)
        if probs is None and key in self.tables:
            counts = self.tables[key]
            freq = counts.sum(0)
            freq = freq / freq.sum().clamp(min=1e-12) if freq.sum() > 0 else torch.full_like(freq, 1 / len(freq))
            probs = (counts + self.alpha * freq) / (counts.sum(1, keepdim=True) + self.alpha).clamp(min=1e-12)
            self._backed[key] = probs
        return probs

    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        self._seen = []

    def observe(self, layer: int, obs: LayerObservation) -> None:
        self._seen.append((layer, obs.ids_NK))

    def forecast(self, layer: int, ahead: int) -> Forecast | None:
        """From the most recent observed layers (up to `sources`) that have a table for this target."""
        total_NE, weight, used = None, 1.0, 0
        for source, ids_NK in reversed(self._seen):
            table = self.backed_off((source, layer, ahead))
            if table is None:
                continue
            valid = (ids_NK >= 0).float()
            probs_NE = (table[ids_NK.clamp(min=0).long()] * valid[..., None]).sum(1)
            probs_NE = probs_NE / probs_NE.sum(1, keepdim=True).clamp(min=1e-12)
            total_NE = weight * probs_NE if total_NE is None else total_NE + weight * probs_NE
            weight, used = weight / 2, used + 1
            if used == self.sources:
                break
        return None if total_NE is None else Forecast(total_NE / total_NE.sum(1, keepdim=True).clamp(min=1e-12))

