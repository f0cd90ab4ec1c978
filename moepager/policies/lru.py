"""Least recently used: evict the candidate whose last request is oldest (ties: lower key)."""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked


class LRU(Ranked):
    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        return stats.last
