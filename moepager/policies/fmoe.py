"""fMoE eviction (fMoE §4.4): evict the largest 1 / (p * freq), i.e. the smallest p * freq.

freq is the LFU count; p the probability the matched expert map gives the expert. There is deliberately no
recency term: layers run in order, so the expert used last is the one needed least soon. Where no prediction
exists (p is NaN) the rank is plain LFU. The 1e-6 floor keeps the LFU order among experts a map gives p = 0.
"""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked


class FMoE(Ranked):
    uses_predictions = True

    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        freq = stats.count.astype(np.float64)
        return np.where(np.isnan(stats.prob), freq, freq * (np.nan_to_num(stats.prob) + 1e-6))
