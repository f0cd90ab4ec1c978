"""Belady's MIN (offline optimal): evict the candidate whose next request is furthest in the future.

It needs the future, so only the trace simulator can run it (it fills `next_use` from the trace); it is the
upper bound every online policy is measured against. With all of a step's experts protected, this is MIN on
the accesses serialised within each step, hence optimal for demand caching.
"""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked


class Belady(Ranked):
    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        return -stats.next_use.astype(np.float64)
