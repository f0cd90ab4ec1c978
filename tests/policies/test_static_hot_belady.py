"""Static-hot keeps the prior's favourites; Belady evicts the furthest next use."""

from __future__ import annotations

import numpy as np

from moepager.policies.base import NEVER, AccessStats
from moepager.policies.belady import Belady
from moepager.policies.static_hot import StaticHot
from moepager.trace.simulate import drive_of


def test_static_hot_evicts_the_lowest_prior_then_least_recent():
    stats = AccessStats.zeros(4)
    stats.prior[:] = [50.0, 3.0, 3.0, 90.0]
    stats.last[:] = [9, 7, 2, 1]
    assert int(np.argmin(StaticHot().priority(stats, 10))) == 2
    assert drive_of("static-hot").preload


def test_belady_evicts_the_furthest_next_use():
    stats = AccessStats.zeros(3)
    stats.next_use[:] = [12, NEVER, 40]
    assert int(np.argmin(Belady().priority(stats, 10))) == 1
    stats.next_use[1] = 11
    assert int(np.argmin(Belady().priority(stats, 10))) == 2
    assert drive_of("belady").offline and not drive_of("lru").offline
