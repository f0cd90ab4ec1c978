"""PLEC's eviction (ExpertFlow §3.3, "Predictive Locality-aware Expert Caching"): evict the expert least
likely to be needed next, by a routing forecast, recency breaking ties.

`prob` is a predictor's probability that the expert is used at the next step of its layer (in the engine, the
prefetcher hands the policy every forecast it makes; in the simulator, a fitted predictor's forecasts replayed
from the trace). The priority is the forecast first and recency second: P = p + last / (step + 2), so a
predicted expert outranks every unpredicted one only as far as its probability goes, and among experts with
the same forecast (e.g. all unpredicted) the least recently used goes first. Where there is no forecast (NaN)
it is LRU. Experts prefetched and then not used keep their old `last`, so they go before the ones just used:
ExpertFlow's real-time correction ("mis-prefetched experts are swapped out first") falls out of the ranking.
"""

from __future__ import annotations

import numpy as np

from moepager.policies.base import AccessStats, Ranked, recency_tiebreak


class PLEC(Ranked):
    uses_predictions = True
    ranks_next_use = True

    def priority(self, stats: AccessStats, step: int) -> np.ndarray:
        return recency_tiebreak(np.nan_to_num(stats.prob), stats.last, step)
