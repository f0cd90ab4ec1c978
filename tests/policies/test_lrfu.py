"""LRFU (Lee et al. 2001): the combined recency and frequency, each request's weight decaying by DECAY a step."""

from __future__ import annotations

import numpy as np
import pytest

from moepager.policies import make_policy
from moepager.policies.base import DECAY, AccessStats
from moepager.types import ExpertKey

A, B, C = ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(0, 2)


def test_crf_sums_the_decayed_requests_in_the_engine_and_in_the_arrays():
    lrfu = make_policy("lrfu", engine=True)
    stats = AccessStats.zeros(3)
    for step in (0, 3, 10):
        lrfu.on_access([A], step)
        stats.touch(0, step)
    expected = DECAY ** 10 + DECAY ** 7 + 1.0
    assert lrfu.score(A, 10) == pytest.approx(expected)
    assert lrfu.score(A, 20) == pytest.approx(expected * DECAY ** 10)
    assert stats.crf[0] == pytest.approx(expected) and stats.count[0] == 3 and stats.last[0] == 10
    mask = np.array([True, False, True])  # the simulator's masked update: each expert once
    stats.touch(mask, 12)
    assert stats.crf[0] == pytest.approx(expected * DECAY ** 2 + 1) and stats.crf[2] == 1.0
    assert stats.last.tolist() == [12, -1, 12]


def test_an_expert_its_requests_keep_coming_back_to_outlasts_one_used_once_just_before():
    lrfu, lru = make_policy("lrfu"), make_policy("lru")
    for policy in (lrfu, lru):
        for step in range(0, 20, 2):
            policy.on_access([A], step)  # every other step
        policy.on_access([B], 20)  # once, most recently
    assert lru.victim([A, B], 21) == A
    assert lrfu.victim([A, B], 21) == B
    for step in range(21, 200):
        lrfu.on_access([B], step)  # now B is the regular one and A's requests have faded
    assert lrfu.victim([A, B], 200) == A


def test_never_requested_experts_go_first():
    lrfu = make_policy("lrfu")
    lrfu.on_access([A], 0)
    assert lrfu.victim([A, C], 5000) == C
