"""LFU ranks by request count, ties by recency; counts survive eviction."""

from __future__ import annotations

from moepager.policies.lfu import LFU
from moepager.types import ExpertKey

A, B, C = ExpertKey(0, 0), ExpertKey(0, 1), ExpertKey(0, 2)


def test_lfu_evicts_least_frequent_then_least_recent():
    lfu = LFU()
    for step, key in enumerate([A, A, B, C, B, A]):
        lfu.on_access([key], step)
    assert lfu.victim([A, B, C], 6) == C
    lfu.on_access([C], 7)  # B and C both at 2: B was used less recently
    assert lfu.victim([A, B, C], 8) == B
    assert lfu.victim([A, C], 8) == C  # counts persist for experts not offered
