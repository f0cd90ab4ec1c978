"""The store's prefetch mechanism: its own lane, no prefetch evicts another, settling a layer's prefetches."""

from __future__ import annotations

from moepager.policies.lru import LRU
from moepager.policies.prefetch_aware import PrefetchAware
from moepager.store.slots import SlotTable
from moepager.types import ExpertKey
from tests.store.test_store import consume, make_store, value


def test_a_consumed_prefetch_is_a_hit_and_counted_used():
    store, reader = make_store(4)
    assert store.prefetch(0, [3]) == 1
    assert consume(store, 0, [3]) == [value(ExpertKey(0, 3))]
    c = store.counters.current
    assert (c.loads_ahead, c.loads_on_demand, c.prefetch_used, dict(c.hits)) == (1, 0, 1, {0: 1})


def test_prefetches_never_evict_each_other():
    store, _ = make_store(4)  # two slots per layer
    assert store.prefetch(1, [0, 1, 2]) == 2
    assert set(store.ahead) == {ExpertKey(1, 0), ExpertKey(1, 1)}


def test_settle_promotes_a_queued_needed_prefetch_and_marks_a_loaded_unneeded_one_stale():
    store, reader = make_store(4)
    reader.gate.clear()  # the prefetch lane's one thread blocks on expert 0; expert 1 waits in its queue
    assert store.prefetch(1, [0, 1]) == 2
    store.settle(1, [1, 5])
    c = store.counters.current
    assert c.prefetch_cancelled == 1 and ExpertKey(1, 1) not in store.device.table.slot_of
    assert c.prefetch_wasted == 1 and ExpertKey(1, 0) in store.order.stale
    assert store.ahead == {}
    reader.gate.set()
    assert consume(store, 1, [1, 5]) == [value(ExpertKey(1, 1)), value(ExpertKey(1, 5))]
    assert c.loads_on_demand == 2 and reader.reads.count(ExpertKey(1, 1)) == 1


def test_stale_experts_go_first_and_prefetches_ahead_last():
    """The correction order is a decorator over any policy: the table only offers candidates."""
    order = PrefetchAware(LRU())
    table = SlotTable(3, [0], order, "layer")
    old, fresh, ahead = ExpertKey(0, 1), ExpertKey(0, 2), ExpertKey(0, 3)
    for step, key in enumerate([ahead, old, fresh]):
        table.claim(key, step)
        order.on_access([key], step)
    order.prefetched(ahead, table.slot_of[ahead])  # least recent, but its layer has not routed yet
    order.stale.add(fresh)  # LRU would evict `ahead`, then `old`; the stale prefetch goes first
    table.claim(ExpertKey(0, 4), 5)
    order.on_access([ExpertKey(0, 4)], 5)
    assert fresh not in table.slot_of and {old, ahead} <= table.slot_of.keys()
    table.claim(ExpertKey(0, 5), 6)
    assert old not in table.slot_of and ahead in table.slot_of  # LRU's choice among the settled ones


def test_a_prefetch_evicted_before_its_layer_routes_is_counted_wasted():
    store, _ = make_store(2, layers=(0,))
    assert store.prefetch(0, [4]) == 1
    store._drain(store.device.table)
    consume(store, 0, [0, 1])  # needs both slots: the prefetched expert must go
    assert store.counters.current.prefetch_wasted == 1 and store.ahead == {}


def test_ranked_prefetch_skips_held_and_slotless_experts_and_stops_at_its_limit():
    store, _ = make_store(4)  # two slots per layer
    consume(store, 0, [1])
    wanted = [(0, 1), (1, 0), (1, 1), (1, 2), (0, 2), (0, 3)]  # (0, 1) resident; layer 1 fits two, not three
    assert store.prefetch_ranked(wanted, limit=3) == 3
    assert set(store.ahead) == {ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(0, 2)}


def test_a_layer_that_uses_some_prefetches_counts_each_once():
    store, _ = make_store(4)
    assert store.prefetch(0, [2, 3]) == 2
    consume(store, 0, [2, 3])
    c = store.counters.current
    assert (c.prefetch_used, dict(c.hits), dict(c.misses)) == (2, {0: 2}, {})
    consume(store, 1, [0, 1, 2])  # three misses in a layer of two slots: one streams
    assert dict(c.misses) == {1: 3} and store.ahead == {}
