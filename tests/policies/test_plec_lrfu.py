"""PLEC-LRFU ranks by the forecast of the next use first and by LRFU's decayed frequency second."""

from __future__ import annotations

import numpy as np

from moepager.policies import make_policy
from moepager.policies.base import AccessStats


def test_plec_lrfu_ranks_the_forecast_first_and_the_decayed_frequency_second():
    stats = AccessStats.zeros(4)
    for step in range(0, 40, 2):
        stats.touch(np.array([0, 3]), step)  # experts 0 and 3 requested every other step
    stats.touch(np.array([1]), 39)  # expert 1 once, most recently; expert 2 never
    stats.prob[:] = [0.0, 0.0, 0.0, 0.3]
    plec_lrfu = make_policy("plec-lrfu").priority(stats, 40)
    assert np.argsort(plec_lrfu, kind="stable").tolist() == [2, 1, 0, 3]
    assert np.argsort(make_policy("plec").priority(stats, 40), kind="stable").tolist() == [2, 0, 1, 3]
    stats.prob[1] = 0.6  # the second term stays below half a certain forecast: 0.6 outranks any frequency
    assert np.argsort(make_policy("plec-lrfu").priority(stats, 40), kind="stable").tolist() == [2, 0, 3, 1]
