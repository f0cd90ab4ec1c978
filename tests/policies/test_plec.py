"""PLEC ranks by the forecast of the next use first and by recency second; without forecasts it is LRU."""

from __future__ import annotations

import numpy as np

from moepager.policies import make_policy
from moepager.policies.base import AccessStats
from moepager.types import ExpertKey


def test_the_forecast_outranks_recency_and_recency_breaks_ties():
    stats = AccessStats.zeros(4)
    stats.last[:] = [90, 99, 95, 98]
    stats.prob[:] = [0.6, 0.0, 0.6, 0.0]
    order = np.argsort(make_policy("plec").priority(stats, 100), kind="stable")
    assert order.tolist() == [3, 1, 0, 2]  # unpredicted first (least recent of them first), then predicted
    stats.last[0] = 0  # idle for the whole run: recency outweighs a 0.6 forecast
    assert np.argsort(make_policy("plec").priority(stats, 100), kind="stable")[0] == 0


def test_without_forecasts_it_is_lru_and_the_engine_feeds_it_by_layer():
    plec, lru = make_policy("plec", engine=True), make_policy("lru", engine=True)
    keys = [ExpertKey(0, e) for e in range(3)]
    for step, key in enumerate([keys[0], keys[1], keys[2], keys[0]]):
        plec.on_access([key], step)
        lru.on_access([key], step)
    assert plec.victim(keys, 4) == lru.victim(keys, 4) == keys[1]
    plec.predict(0, np.array([0.0, 0.9, 0.0]))  # expert 1 is forecast for the next token
    assert plec.victim(keys, 4) == keys[2]
    assert plec.ranks_next_use and plec.uses_predictions
