"""Random replacement (the RND baseline of MoEpic Table 1): evict a uniformly random candidate, seeded."""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked


class RND(Ranked):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = np.random.default_rng(seed)

    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        return self._rng.random(stats.count.shape)
