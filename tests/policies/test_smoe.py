"""SMoE: fixed-N always loads N uncached predictions per layer, adaptive only those in the top N."""

from __future__ import annotations

import numpy as np

from moepager.policies.smoe import SMoE
from moepager.trace.simulate import drive_of


def test_fixed_n_walks_down_the_ranking_past_cached_experts():
    cached = np.zeros((2, 6), bool)
    cached[0, [0, 1]] = True
    cached[1, [3]] = True
    ranked = np.array([[0, 1, 2, 3, 4], [5, 3, -1, -1, -1]])
    load = SMoE(n=2).admissions(ranked, cached)
    assert np.flatnonzero(load[0]).tolist() == [2, 3]  # 0 and 1 are cached: the next two
    assert np.flatnonzero(load[1]).tolist() == [5]  # a short ranking loads what it has


def test_adaptive_loads_only_the_top_n_that_are_missing():
    cached = np.zeros((1, 6), bool)
    cached[0, 0] = True
    ranked = np.array([[0, 1, 2, 3]])
    assert np.flatnonzero(SMoE(n=2, adaptive=True).admissions(ranked, cached)[0]).tolist() == [1]
    assert drive_of("smoe-adaptive").admits_on_miss is False
