"""Static-hot: keep the experts a prior says are most frequent (the static baseline of the seed papers).

The cache starts filled with each layer's highest-prior experts; a miss is loaded into the slot of the
cached expert with the lowest prior (ties: least recently used), so the hot set stays and one slot rotates.
"""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked


class StaticHot(Ranked):
    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        return stats.prior + (stats.last + 1.0) / (step + 2.0) * 1e-9
