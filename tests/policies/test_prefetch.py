"""Prefetch policies: what a layer's routing does to its prefetches (expertflow corrects them, plain lets them be),
what a prefetch may evict, how queued prefetches rank; and the registry."""

from __future__ import annotations

import pytest

from moepager.policies.lru import LRU
from moepager.policies.prefetch import PREFETCH_POLICIES, UnknownPrefetchPolicyError, make_prefetch_policy
from moepager.types import ExpertKey
from tests.store.test_store import consume, make_store, next_pass, value


def test_the_verdicts_of_each_policy():
    expertflow, plain = make_prefetch_policy("expertflow", LRU()), make_prefetch_policy("plain", LRU())
    cases = ((True, True), (True, False), (False, True), (False, False))  # (needed, loading)
    assert [expertflow.settle_actions(n, lo) for n, lo in cases] \
        == [("cancel", "promote"), (), ("cancel", "abandon", "stale"), ("stale",)]  # the actions tried in order
    assert [plain.settle_actions(n, lo) for n, lo in cases] == [(), (), ("release",), ("release",)]
    assert expertflow.protects_forecast and not plain.protects_forecast
    assert expertflow.priority(0.9, 3) == pytest.approx(0.3)  # fMoE: mass over the layers until it is needed


def test_the_registry_fails_loudly():
    assert list(PREFETCH_POLICIES) == ["expertflow", "plain"]
    with pytest.raises(UnknownPrefetchPolicyError, match=r"unknown prefetch policy 'fifo'; choose from \['expertflow'"):
        make_prefetch_policy("fifo", LRU())


def test_plain_lets_a_queued_prefetch_run_and_releases_an_unneeded_one_as_an_ordinary_resident():
    store, reader = make_store(4, prefetch="plain")
    reader.gate.clear()  # the prefetch lane's one thread blocks on expert 0; expert 1 waits in its queue
    assert store.prefetch(1, [0, 1]) == 2
    store.settle(1, [1, 5])
    c = store.counters.current
    assert c.prefetch_cancelled == 0 and ExpertKey(1, 1) in store.device.table.slot_of  # not cancelled: it runs
    assert c.prefetch_wasted == 1 and store.order.stale == set()  # expert 0: released, not stale
    assert set(store.ahead) == {ExpertKey(1, 1)}  # the needed one stays ahead until its layer uses it
    reader.gate.set()
    assert consume(store, 1, [1, 5]) == [value(ExpertKey(1, 1)), value(ExpertKey(1, 5))]
    assert reader.reads.count(ExpertKey(1, 1)) == 1 and c.prefetch_used == 1 and store.ahead == {}


def test_plain_may_evict_a_resident_expert_the_forecast_names_expertflow_may_not():
    for name, victim in (("expertflow", 1), ("plain", 0)):
        store, _ = make_store(4, prefetch=name, streams=0)  # two slots a layer
        consume(store, 0, [0])
        next_pass(store)
        consume(store, 0, [1])  # layer 0's cache is full; 0 is the least recently used
        assert store.prefetch_ranked([(0, 0), (0, 2)], 1) == 1  # the forecast names resident 0, then 2
        assert {k.expert for k in store.device.table.slot_of if k.layer == 0} == {0, 1, 2} - {victim}, name
