"""LRU ranks by last access."""

from __future__ import annotations

from moepager.policies.lru import LRU
from moepager.types import ExpertKey


def test_lru_evicts_least_recently_accessed():
    lru = LRU()
    a, b, c = ExpertKey(0, 1), ExpertKey(0, 2), ExpertKey(1, 0)
    for step, key in enumerate([a, b, c, a]):
        lru.on_access([key], step)
    assert lru.victim([a, b, c], 4) == b
    lru.on_access([b], 5)
    assert lru.victim([a, b, c], 6) == c
    assert lru.victim([ExpertKey(3, 3), a], 6) == ExpertKey(3, 3)  # never accessed goes first


def test_one_access_of_a_layer_records_every_expert_at_its_step():
    lru = LRU()
    a, b, c = ExpertKey(0, 1), ExpertKey(0, 2), ExpertKey(0, 3)
    lru.on_access([a, b], 0)
    lru.on_access([c, a], 1)
    assert lru.victim([a, b, c], 2) == b
    assert [int(lru.stats.count[lru._row(k)]) for k in (a, b, c)] == [2, 1, 1]
