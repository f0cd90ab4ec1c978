"""fMoE eviction: smallest p * freq goes (no recency); plain LFU without predictions."""

from __future__ import annotations

import numpy as np

from moepager.policies import make_policy
from moepager.policies.base import AccessStats
from moepager.policies.fmoe import FMoE
from moepager.types import ExpertKey


def test_probability_reweights_frequency():
    stats = AccessStats.zeros(3)
    stats.count[:] = [10, 2, 5]
    stats.last[:] = [0, 9, 5]
    stats.prob[:] = [0.01, 0.9, 0.5]  # 0.1, 1.8, 2.5
    assert int(np.argmin(FMoE().priority(stats, 10))) == 0
    stats.prob[:] = [0.5, 0.0, 0.0]  # p = 0 for two: the less frequent of them
    assert int(np.argmin(FMoE().priority(stats, 10))) == 1


def test_without_predictions_it_is_lfu_without_recency():
    fmoe = FMoE()
    a, b = ExpertKey(1, 0), ExpertKey(1, 1)
    for step, key in enumerate([a, a, b]):
        fmoe.on_access([key], step)
    assert fmoe.victim([a, b], 3) == b
    fmoe.on_access([b], 4)  # both at 2: no recency term, the lower key goes
    assert fmoe.victim([a, b], 5) == a


def test_engine_fmoe_evicts_by_the_predictors_probability_times_frequency():
    policy = make_policy("fmoe", engine=True)
    a, b = ExpertKey(2, 0), ExpertKey(2, 1)
    for step in range(3):
        policy.on_access([a], step)  # a is used three times, b once: plain LFU would evict b
    policy.on_access([b], 3)
    assert policy.victim([a, b], 4) == b
    policy.predict(2, np.array([0.01, 0.9]))  # the forecast says b comes next and a hardly
    assert policy.victim([a, b], 4) == a
