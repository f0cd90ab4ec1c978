"""Least frequently used: evict the candidate requested fewest times so far (ties: least recent, then key).

Counts persist while an expert is out of the cache (frequency is a property of the workload, not of the
cache's contents), as in the LFU baselines of MoEpic and SMoE.
"""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked, recency_tiebreak


class LFU(Ranked):
    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        return recency_tiebreak(stats.count.astype(np.float64), stats.last, step)
