"""The store's prefetch mechanism: its own lane, no prefetch evicts another, settling a layer's prefetches."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from moepager.errors import CheckpointError
from moepager.policies.lru import LRU
from moepager.policies.prefetch import PrefetchAware
from moepager.store.keyspace import SplitParts
from moepager.store.slots import SlotTable
from moepager.types import ExpertKey
from tests.store.test_store import FakeReader, consume, make_store, value


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


class HeldReader(FakeReader):
    """Reads of the experts in `held` wait for their event."""

    def __init__(self):
        super().__init__()
        self.held: dict[ExpertKey, threading.Event] = {}

    def __call__(self, key: ExpertKey, out: torch.Tensor, between=None) -> int:
        if key in self.held:
            self.held[key].wait(timeout=10)
        return super().__call__(key, out)


@pytest.mark.parametrize("host", [None, 12], ids=["disk", "host-tier"])
def test_settle_abandons_an_unneeded_prefetch_waiting_for_demand_and_promotes_a_needed_one(host):
    """Two prefetches for layer 1 wait on their lane while a demand load of layer 0 is in flight. Layer 1 routes to
    one of them: the other is abandoned (never read, its slot free, and over a host tier the host slot claimed for
    its read too), the needed one reads at once, before the demand load ends."""
    reader = HeldReader()
    store, _ = make_store(8, reader=reader, ahead_threads=2, host=host)
    reader.held[ExpertKey(0, 5)] = release = threading.Event()
    try:
        held = store.acquire(0, [5])  # a demand load, in flight until `release`
        assert store.prefetch(1, [0, 1]) == 2
        time.sleep(0.05)
        assert reader.reads == []  # both wait for the demand load
        store.settle(1, [1, 3])
        c = store.counters.current
        assert c.prefetch_cancelled == 1 and ExpertKey(1, 0) not in store.device.table.slot_of
        deadline = time.monotonic() + 10
        while ExpertKey(1, 1) not in reader.reads and time.monotonic() < deadline:
            time.sleep(0.005)
        assert reader.reads == [ExpertKey(1, 1)]  # promoted: it did not wait for the demand load
    finally:
        release.set()
    store.wait(held, [0])
    store.release(held)
    assert consume(store, 1, [1, 3]) == [value(ExpertKey(1, 1)), value(ExpertKey(1, 3))]
    assert ExpertKey(1, 0) not in reader.reads and c.prefetch_used == 1
    if host:
        assert ExpertKey(1, 0) not in store.host.table.slot_of and ExpertKey(1, 1) in store.host.table.slot_of
    assert consume(store, 1, [0]) == [value(ExpertKey(1, 0))]  # read again, on demand, whole
    store.close()


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


def test_a_prefetch_never_evicts_a_resident_expert_its_forecast_names():
    """The forecast for layer 0 is experts 3 and 1; 1 is resident and least recently used, so LRU alone would
    evict it for 3 and the layer would then miss it. It stays; 2, which the forecast does not name, goes."""
    store, reader = make_store(4)  # two slots per layer
    consume(store, 0, [1])
    consume(store, 0, [2])
    assert store.prefetch_ranked([(0, 3), (0, 1)], limit=2) == 1
    store._drain(store.device.table)
    assert set(store.device.table.by_layer[0]) == {ExpertKey(0, 1), ExpertKey(0, 3)}
    consume(store, 0, [3, 1])
    assert reader.reads.count(ExpertKey(0, 1)) == 1 and store.counters.current.loads_on_demand == 2


def test_a_layer_whose_forecast_is_all_resident_prefetches_nothing_there():
    store, _ = make_store(4)
    consume(store, 0, [1, 2])
    assert store.prefetch_ranked([(0, 1), (0, 2), (0, 3), (1, 0)], limit=2) == 1  # layer 1 still takes one
    assert set(store.ahead) == {ExpertKey(1, 0)}


def test_a_layer_that_uses_some_prefetches_counts_each_once():
    store, _ = make_store(4)
    assert store.prefetch(0, [2, 3]) == 2
    consume(store, 0, [2, 3])
    c = store.counters.current
    assert (c.prefetch_used, dict(c.hits), dict(c.misses)) == (2, {0: 2}, {})
    consume(store, 1, [0, 1, 2])  # three misses in a layer of two slots: one streams
    assert dict(c.misses) == {1: 3} and store.ahead == {}


def test_several_victims_at_once_follow_the_correction_order():
    """Stale first, then the inner policy's order among those not ahead, those ahead last."""
    order = PrefetchAware(LRU())
    keys = [ExpertKey(0, e) for e in range(6)]
    for step, key in enumerate(keys):
        order.on_access([key], step)
    order.prefetched(keys[0], 0)
    order.prefetched(keys[1], 1)
    order.stale.update({keys[4], keys[3]})
    assert order.victims(keys, 6, 9) == [keys[3], keys[4], keys[2], keys[5], keys[0], keys[1]]
    assert order.victims(keys, 3, 9) == [keys[3], keys[4], keys[2]]
    assert order.victims(keys[:2], 1, 9) == [keys[0]]


def test_claiming_several_keys_at_once_gives_the_slots_of_claims_in_a_row():
    def table_with_history() -> SlotTable:
        table = SlotTable(6, [0, 1], PrefetchAware(LRU()), "layer")
        for step, e in enumerate([1, 2, 3, 7, 8]):
            layer = 0 if e < 7 else 1
            table.claim(ExpertKey(layer, e), step)
            table.policy.on_access([ExpertKey(layer, e)], step)
        table.policy.on_access([ExpertKey(0, 1)], 6)  # 2 is now the least recent of layer 0
        return table
    wanted = [ExpertKey(0, 4), ExpertKey(0, 5)]
    one, evicted_one = table_with_history(), []
    one.on_evict = evicted_one.extend
    for key in wanted:
        one.claim(key, 7)
        one.pins[one.slot_of[key]] += 1  # acquire pins each claimed miss
    many, evicted_many = table_with_history(), []
    many.on_evict = evicted_many.extend
    assert many.claim_many(wanted, 7) == [one.slot_of[k] for k in wanted]
    assert evicted_many == evicted_one == [ExpertKey(0, 2), ExpertKey(0, 3)]
    assert many.slot_of == one.slot_of and many.by_layer == one.by_layer
    many.pins[many.slot_of[ExpertKey(0, 1)]] += 1  # nothing of layer 0 evictable now: a shorter answer
    for key in wanted:
        many.pins[many.slot_of[key]] += 1
    assert many.claim_many([ExpertKey(0, 9)], 8) == []


def test_misses_claimed_together_keep_their_slots_when_the_claim_waits_for_loads_in_flight():
    """Two misses, one evictable slot: the first is claimed, the store waits for the prefetches in flight, and the
    second must not evict the first (its load landed during the wait): each expert keeps its own slot."""
    store, reader = make_store(3, layers=(0,))
    assert consume(store, 0, [0, 1, 2]) == [0, 1, 2]
    reader.gate.clear()
    assert store.prefetch(0, [3, 4]) == 2  # evict 0 and 1; loading until the gate opens
    threading.Timer(0.05, reader.gate.set).start()
    assert consume(store, 0, [5, 6]) == [5, 6]
    assert len(set(store.device.table.slot_of.values())) == len(store.device.table.slot_of)


class JitteryReader(FakeReader):
    """Loads that take 0-2 ms, in a seeded random order of durations: prefetches and demand loads overlap."""

    def __init__(self, seed: int):
        super().__init__()
        self._delays = random.Random(seed)

    def __call__(self, key: ExpertKey, out: torch.Tensor, between=None) -> int:
        with self._lock:
            delay = self._delays.random() * 0.002
        time.sleep(delay / 2)
        if between is not None:  # a prefetch gives way to demand loads half way
            between()
        time.sleep(delay / 2)
        return super().__call__(key, out)


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("seed", range(4))
def test_every_expert_computed_holds_its_own_weights_while_prefetches_race_demand_loads(seed, scope):
    """Random layers of 1-4 experts, prefetches ahead of them that are right or wrong, settled as the engine does,
    with loads of random duration: each expert consumed reads its own value and no two experts share a slot."""
    store, _ = make_store(6, layers=(0, 1, 2), scope=scope, reader=JitteryReader(seed), io_threads=2)
    rng = random.Random(seed)
    for _ in range(60):
        layer = rng.randrange(3)
        experts = sorted(rng.sample(range(8), rng.randint(1, 4)))
        store.prefetch((layer + 1) % 3, rng.sample(range(8), rng.randint(0, 3)))
        store.settle(layer, experts)
        assert consume(store, layer, experts) == [value(ExpertKey(layer, e)) for e in experts]
        slot_of = store.device.table.slot_of
        assert len(set(slot_of.values())) == len(slot_of)
    store._drain(store.device.table)
    assert all(p == 0 for p in store.device.table.pins)
    store.close()


def test_a_failed_read_while_misses_wait_for_a_slot_leaves_no_claimed_slot_without_its_expert():
    """The store waits for the prefetches in flight to free a slot for the second miss, and one of them fails: the
    error reaches the layer, and the first miss, already claimed, still holds its own expert (it was loading before
    the wait began), not whatever its slot held before."""
    store, reader = make_store(3, layers=(0,))
    assert consume(store, 0, [0, 1, 2]) == [0, 1, 2]
    reader.gate.clear()
    reader.fail.add(ExpertKey(0, 3))
    assert store.prefetch(0, [3, 4]) == 2
    threading.Timer(0.05, reader.gate.set).start()
    with pytest.raises(CheckpointError):
        consume(store, 0, [5, 6])
    assert consume(store, 0, [5]) == [5]


def test_ranked_prefetch_claims_a_repeated_expert_once_and_fills_its_limit_across_layers():
    store, _ = make_store(4)  # two slots per layer
    wanted = [(1, 0), (1, 0), (0, 3), (1, 1), (1, 2), (0, 3), (0, 1)]
    assert store.prefetch_ranked(wanted, limit=4) == 4  # layer 1 takes two; layer 0 the next two distinct ones
    assert set(store.ahead) == {ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(0, 3), ExpertKey(0, 1)}


def test_settle_cancels_every_part_of_a_split_expert_read_in_one_request():
    """Split experts (two parts each, both cached): a prefetch reads an expert's parts in one request, one ticket for
    both slots. Cancelling it forgets both parts (the second once held a cancelled ticket, which a later hit waited on
    and raised CancelledError), and the expert then loads on demand with its own values."""
    store, reader = make_store(8)

    def read_many(keys, dsts, between=None) -> int:
        return sum(reader(key, dst) for key, dst in zip(keys, dsts))
    store.read_many = read_many
    store.use(SplitParts(2, {0: 2, 1: 2}))
    reader.gate.clear()  # the prefetch lane's one thread blocks on expert 0's parts; expert 1's wait in its queue
    assert store.prefetch(1, [0, 1, 2, 3]) == 4
    tickets = store.device.table.ticket
    slot_of = store.device.table.slot_of
    assert tickets[slot_of[ExpertKey(1, 2)]] is tickets[slot_of[ExpertKey(1, 3)]]  # one read for expert 1's parts
    store.settle(1, [0, 1])
    assert ExpertKey(1, 2) not in slot_of and ExpertKey(1, 3) not in slot_of
    assert store.counters.current.prefetch_cancelled == 2
    reader.gate.set()
    assert consume(store, 1, [0, 1, 2, 3]) == [value(ExpertKey(1, e)) for e in range(4)]

