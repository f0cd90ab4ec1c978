"""What a trace's routing looks like, per layer: how unevenly experts are used and how much consecutive tokens
share experts — the two properties caching (skew) and recency/prediction (locality) exploit.

- `entropy_bits`: entropy of the layer's expert-use distribution (counts of all recorded choices). A uniform
  router reaches log2(E); `entropy_ratio` is entropy / log2(E).
- `top_quarter_share`: fraction of all choices that go to the most used E/4 experts (0.25 if uniform).
- `repeat_rate`: mean over tokens that have a predecessor in the same request of |S_t ∩ S_t-1| / K, where S is
  the token's set of chosen experts at that layer; `repeat_rate_random` = K / E is what independent uniform
  choices would give.
Shape legend: T tokens, L traced MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from moepager.trace.format import MISSING, TraceReader


@dataclass(frozen=True)
class LayerRouting:
    layer: int
    """Decoder-layer index."""
    choices: int
    entropy_bits: float
    entropy_ratio: float
    top_quarter_share: float
    repeat_rate: float


@dataclass(frozen=True)
class RoutingStats:
    model: str
    num_experts: int
    top_k: int
    requests: int
    tokens: int
    layers: list[LayerRouting]

    @property
    def repeat_rate_random(self) -> float:
        return self.top_k / self.num_experts

    def mean(self, field: str) -> float:
        return float(np.mean([getattr(layer, field) for layer in self.layers]))

    def to_json(self) -> dict:
        return {**asdict(self), "repeat_rate_random": self.repeat_rate_random,
                "mean": {f: self.mean(f) for f in ("entropy_bits", "entropy_ratio", "top_quarter_share",
                                                   "repeat_rate")}}


def _overlap_TL(ids_TLK: np.ndarray) -> np.ndarray:
    """For tokens 1..T-1: how many of each token's experts the previous token also chose, per layer."""
    prev, cur = ids_TLK[:-1], ids_TLK[1:]
    same = (cur[..., :, None] == prev[..., None, :]) & (cur[..., :, None] != MISSING)
    return same.any(-1).sum(-1)


def routing_stats(path: str, progress: Callable[[int], None] | None = None) -> RoutingStats:
    """Read the trace one request at a time and summarise its routing per layer (`progress(1)` per request)."""
    with TraceReader(path) as reader:
        h = reader.header
        counts_LE = np.zeros((h.num_layers, h.num_experts), np.int64)
        overlap_L = np.zeros(h.num_layers, np.int64)
        pairs_L = np.zeros(h.num_layers, np.int64)
        tokens = 0
        for request in reader:
            if progress is not None:
                progress(1)
            ids = request.ids_TLK.astype(np.int64)
            tokens += request.num_tokens
            for layer in range(h.num_layers):
                valid = ids[:, layer][ids[:, layer] != MISSING]
                counts_LE[layer] += np.bincount(valid, minlength=h.num_experts)
            if request.num_tokens > 1:
                complete = (ids[1:] != MISSING).all(-1) & (ids[:-1] != MISSING).all(-1)
                overlap_L += np.where(complete, _overlap_TL(ids), 0).sum(0)
                pairs_L += complete.sum(0)
        layers = [_layer(h.moe_layers[i], counts_LE[i], overlap_L[i], pairs_L[i], h.top_k)
                  for i in range(h.num_layers)]
        return RoutingStats(h.model, h.num_experts, h.top_k, len(reader), tokens, layers)


def _layer(layer: int, counts_E: np.ndarray, overlap: int, pairs: int, top_k: int) -> LayerRouting:
    total = int(counts_E.sum())
    p = counts_E[counts_E > 0] / max(total, 1)
    entropy = float(-(p * np.log2(p)).sum())
    quarter = max(1, len(counts_E) // 4)
    top = float(np.sort(counts_E)[::-1][:quarter].sum() / max(total, 1))
    return LayerRouting(layer, total, entropy, entropy / np.log2(len(counts_E)), top,
                        overlap / max(pairs * top_k, 1))


def format_stats(stats: RoutingStats) -> str:
    lines = [f"{stats.model}: {stats.requests} requests, {stats.tokens} tokens, top-{stats.top_k} of "
             f"{stats.num_experts} (uniform: entropy {np.log2(stats.num_experts):.2f} bits, top-quarter share 25%, "
             f"repeat rate {stats.repeat_rate_random:.1%})",
             "layer  entropy bits  of max  top-quarter share  repeat rate"]
    for r in stats.layers:
        lines.append(f"{r.layer:>5}  {r.entropy_bits:>12.2f}  {r.entropy_ratio:>6.1%}  {r.top_quarter_share:>17.1%}"
                     f"  {r.repeat_rate:>11.1%}")
    lines.append(f"{'mean':>5}  {stats.mean('entropy_bits'):>12.2f}  {stats.mean('entropy_ratio'):>6.1%}  "
                 f"{stats.mean('top_quarter_share'):>17.1%}  {stats.mean('repeat_rate'):>11.1%}")
    return "\n".join(lines)
