"""The store's mechanism on a fake reader: ordering, pins, quotas, no duplicate loads, errors, statistics."""

from __future__ import annotations

import threading

import pytest
import torch

from moepager.errors import CheckpointError
from moepager.policies.lru import LRU
from moepager.policies.prefetch import make_prefetch_policy
from moepager.store.slots import SlotTable
from moepager.store.store import ExpertStore
from moepager.store.tiers import Tier
from moepager.store.transfer import Transfers
from moepager.types import ExpertKey, PassInfo

NUMEL = 16


class FakeReader:
    """Fills a buffer with 1000 * layer + expert; counts reads; can be held at a gate or made to fail."""

    def __init__(self):
        self.reads: list[ExpertKey] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail: set[ExpertKey] = set()
        self._lock = threading.Lock()

    def __call__(self, key: ExpertKey, out: torch.Tensor, between=None) -> int:
        self.gate.wait(timeout=10)
        with self._lock:
            self.reads.append(key)
        if key in self.fail:
            raise CheckpointError(f"cannot read {key}")
        out.fill_(1000 * key.layer + key.expert)
        return out.numel() * out.element_size()


def value(key: ExpertKey) -> float:
    return 1000.0 * key.layer + key.expert


def make_store(capacity, layers=(0, 1), scope="layer", host=None, reader=None, io_threads=2, streams=2,
               ahead_threads=1, prefetch="expertflow"):
    """A store of `capacity` cached slots and `streams` stream rows (over a host tier of `host` slots, one cache
    for all layers as the engine builds it)."""
    reader = reader or FakeReader()

    def tier(n, scope, streams=0, policy=None):
        return Tier(SlotTable(n, list(layers), policy or LRU(), scope, streams), torch.zeros(n + streams, NUMEL))

    device = tier(capacity, scope, streams, make_prefetch_policy(prefetch, LRU()))  # as the builder composes it
    store = ExpertStore(device, tier(host, "global") if host else None, reader,
                        Transfers(torch.device("cpu"), io_threads, ahead_threads))
    return store, reader


def next_pass(store) -> None:
    """The store's next forward pass, as the engine announces it (in the phase the test set)."""
    phase = next(p for p, c in store.counters.phases.items() if c is store.counters.current)
    store.begin_pass(PassInfo(store.clock, phase, (0,), (0,), (1,), (phase,), torch.zeros(1, dtype=torch.long)))


def consume(store, layer, experts, check=None):
    """Values seen for each expert, read while that expert is the one in use (one forward pass per call)."""
    next_pass(store)
    seen = []
    for slot in store.stream(layer, experts):
        if check is not None:
            check(slot)
        seen.append(float(store.device.buffers[slot][0]))
    return seen


@pytest.mark.parametrize("host", [None, 3, 12], ids=["disk", "small-host", "all-host"])
@pytest.mark.parametrize("capacity", [2, 3, 5, 8])
def test_stream_yields_each_expert_in_order_at_any_capacity(capacity, host):
    store, _ = make_store(capacity, host=host)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        layer = int(torch.randint(0, 2, (1,), generator=gen))
        experts = sorted(torch.randperm(6, generator=gen)[: int(torch.randint(1, 7, (1,), generator=gen))].tolist())
        assert consume(store, layer, experts) == [value(ExpertKey(layer, e)) for e in experts]
    assert all(p == 0 for p in store.device.table.pins)
    store.close()


def test_expert_in_use_is_never_overwritten_while_later_loads_land():
    store, _ = make_store(2, layers=(0,))

    def check(slot):
        store._drain(store.device.table)  # let every look-ahead load finish while this expert is in use
        assert store.device.table.pins[slot] >= 1

    seen = consume(store, 0, [0, 1, 2, 3, 4, 5], check)
    assert seen == [0, 1, 2, 3, 4, 5]


def test_a_load_in_flight_is_not_issued_twice():
    store, reader = make_store(4)
    reader.gate.clear()
    assert store.prefetch(0, [3]) == 1
    assert store.prefetch(0, [3]) == 0  # already loading
    threading.Timer(0.05, reader.gate.set).start()
    assert consume(store, 0, [3]) == [3.0]
    assert reader.reads == [ExpertKey(0, 3)]
    c = store.counters.current
    assert (c.loads_ahead, c.loads_on_demand, c.hits[0], c.misses[0]) == (1, 0, 1, 0)
    assert c.exposed_s > 0


def test_lru_within_a_layer_and_per_layer_quota():
    store, reader = make_store(4, layers=(0, 1))
    consume(store, 1, [0, 1])
    consume(store, 0, [0, 1])
    consume(store, 0, [2])  # layer 0 at its quota of 2: evicts its own least recent (0), not layer 1's
    assert set(store.device.table.slot_of) == {ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(0, 1), ExpertKey(0, 2)}
    consume(store, 0, [1])
    consume(store, 0, [3])  # 2 is now least recent in layer 0
    assert ExpertKey(0, 2) not in store.device.table.slot_of and ExpertKey(0, 1) in store.device.table.slot_of


def test_global_scope_lets_one_layer_take_every_slot():
    store, _ = make_store(4, layers=(0, 1), scope="global")
    consume(store, 1, [0])
    consume(store, 0, [0, 1, 2, 3])
    assert set(store.device.table.slot_of) == {ExpertKey(0, e) for e in range(4)}


def cached(store) -> set[ExpertKey]:
    return set(store.device.table.slot_of)


def test_a_layer_needing_more_than_its_quota_streams_the_rest_and_takes_no_other_layers_slot():
    store, reader = make_store(4, layers=(0, 1))  # quotas 2 and 2, two stream rows
    consume(store, 1, [0, 1])
    assert consume(store, 0, [0, 1, 2, 3, 4]) == [0, 1, 2, 3, 4]
    assert cached(store) == {ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(0, 0), ExpertKey(0, 1)}  # first misses
    consume(store, 0, [1, 3])  # 3 streamed through: a miss again, evicting layer 0's least recent (0)
    assert cached(store) == {ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(0, 1), ExpertKey(0, 3)}
    assert consume(store, 0, [0, 1, 2, 3]) == [0, 1, 2, 3]  # hits 1 and 3 fill the quota: 0 and 2 stream
    assert cached(store) == {ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(0, 1), ExpertKey(0, 3)}
    c = store.counters.current
    assert (c.hits[0], c.misses[0], c.loads_on_demand) == (3, 8, 2 + 8) and len(reader.reads) == 10
    assert all(p == 0 for p in store.device.table.pins)


def test_a_layer_with_no_slot_of_its_own_streams_everything():
    store, reader = make_store(1, layers=(0, 1), streams=1)  # quotas 1 and 0: layer 1 has only the stream row
    for _ in range(2):
        assert consume(store, 1, [2, 4, 5]) == [1002, 1004, 1005]
    assert cached(store) == set() and len(reader.reads) == 6


def test_without_stream_rows_a_layer_beyond_its_quota_is_refused():
    store, _ = make_store(2, layers=(0,), streams=0)
    with pytest.raises(RuntimeError, match="needs 3 experts at once but holds 2 and has no stream rows"):
        consume(store, 0, [0, 1, 2])
    assert all(p == 0 for p in store.device.table.pins)


def test_a_stream_row_is_reused_only_after_its_expert_was_computed():
    """The executor's protocol: loads into the stream rows start at acquire; `recycle` hands each row on."""
    store, reader = make_store(1, layers=(0,), streams=2)
    next_pass(store)
    held = store.acquire(0, [0, 1, 2, 3])
    assert held.queued == [3] and held.streaming == 2  # 0 cached, 1 and 2 in the rows, 3 waits
    rows = {held.slots[1], held.slots[2]}
    assert rows == set(store.device.table.stream_rows)
    store.wait(held, [0, 1, 2])
    assert float(store.device.buffers[held.slots[2]][0]) == 2.0
    assert store.recycle(held, [0, 2]) == [3]  # 0 is cached (nothing to hand on); 2's row takes 3
    assert held.slots[3] in rows and held.slots[2] == -1
    store.wait(held, [3])
    assert float(store.device.buffers[held.slots[3]][0]) == 3.0
    assert float(store.device.buffers[held.slots[1]][0]) == 1.0  # the other row still holds 1
    store.release(held)
    assert all(p == 0 for p in store.device.table.pins) and cached(store) == {ExpertKey(0, 0)}


def test_hits_misses_and_bytes_are_counted_per_phase():
    store, reader = make_store(4, layers=(0,))
    store.counters.set_phase("prefill")
    consume(store, 0, [0, 1, 2])
    store.counters.set_phase("decode")
    consume(store, 0, [1, 2])
    consume(store, 0, [3])
    pre, dec = store.counters.phases["prefill"], store.counters.phases["decode"]
    assert (pre.misses[0], pre.hits[0], pre.loads_on_demand, pre.disk_reads) == (3, 0, 3, 3)
    assert (dec.misses[0], dec.hits[0], dec.bytes_disk) == (1, 2, NUMEL * 4)
    summary = dec.summary(tokens=3)
    assert summary["hit_rate"] == pytest.approx(2 / 3) and summary["bytes_disk_per_token"] == pytest.approx(64 / 3)


def test_host_tier_serves_repeat_misses_without_disk():
    store, reader = make_store(2, layers=(0,), host=6)
    consume(store, 0, [0, 1, 2, 3])  # 0 and 1 cached, 2 and 3 streamed through
    consume(store, 0, [2, 3])
    assert len(reader.reads) == 4  # the second 2 and 3 came from the host tier
    c = store.counters.current
    assert c.host_hits == 2 and c.bytes_host_to_device == 6 * NUMEL * 4


def test_failed_read_reaches_the_consumer():
    store, reader = make_store(2)
    reader.fail.add(ExpertKey(1, 4))
    with pytest.raises(CheckpointError, match="cannot read"):
        consume(store, 1, [0, 4])
    assert all(p == 0 for p in store.device.table.pins)  # an interrupted stream unpins what it held
    reader.fail.clear()
    assert consume(store, 1, [4]) == [1004.0]  # the failed slot was dropped, so a retry reads again


def test_warm_fills_slots_respecting_quotas():
    store, reader = make_store(3, layers=(0, 1))
    store.warm([ExpertKey(layer, e) for e in range(4) for layer in (0, 1)])
    assert set(store.device.table.slot_of) == {ExpertKey(0, 0), ExpertKey(1, 0), ExpertKey(0, 1)}
    assert consume(store, 1, [0]) == [1000.0] and store.counters.current.loads_on_demand == 0


def acquired(store, layer, experts):
    """Values of `experts` through acquire/wait/release (the executor's path), one forward pass."""
    next_pass(store)
    held = store.acquire(layer, experts)
    try:
        assert sorted(held.ready + held.pending) == list(range(len(experts)))
        assert all(store.device.table.pins[s] >= 1 for s in held.slots)
        store.wait(held, range(len(experts)))
        return [float(store.device.buffers[s][0]) for s in held.slots]
    finally:
        store.release(held)


@pytest.mark.parametrize("host", [None, 3, 12], ids=["disk", "small-host", "all-host"])
def test_acquire_pins_a_whole_layer_and_agrees_with_stream(host):
    """Same experts, same evictions: acquire (hits pinned before any miss claims a slot) and stream pick the
    same victims, so the hit/miss counts the simulator checks are the same on both paths."""
    a, _ = make_store(4, host=host)
    b, _ = make_store(4, host=host)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        layer = int(torch.randint(0, 2, (1,), generator=gen))
        experts = sorted(torch.randperm(6, generator=gen)[: int(torch.randint(1, 5, (1,), generator=gen))].tolist())
        expected = [value(ExpertKey(layer, e)) for e in experts]
        assert acquired(a, layer, experts) == consume(b, layer, experts) == expected
        assert a.device.table.slot_of.keys() == b.device.table.slot_of.keys()
    ca, cb = a.counters.current, b.counters.current
    assert (ca.hits, ca.misses) == (cb.hits, cb.misses)
    assert all(p == 0 for p in a.device.table.pins)
    a.close()
    b.close()


def test_prefetch_copies_out_of_the_host_tier_take_the_prefetch_stream_and_demand_copies_the_other():
    """On CUDA a prefetch copy runs on its own stream (`Transfers.ahead_stream`), so a demand copy never queues
    behind prefetch copies on one stream; here the lane each copy asked for is recorded."""
    store, _ = make_store(4, layers=(0, 1), host=6)
    lanes: list[tuple[float, bool]] = []
    copy = store.transfers.copy

    def recording(dst, src, after, ahead=False):
        lanes.append((float(src[0]), ahead))
        return copy(dst, src, after, ahead)
    store.transfers.copy = recording
    consume(store, 0, [0, 1])  # both read from disk into the host tier, then copied on demand
    next_pass(store)
    assert store.prefetch(1, [3]) == 1
    store.transfers.pool.submit(lambda: None).result()  # (the lanes' threads have run their jobs)
    store.transfers.ahead_pool.submit(lambda: None).result()
    assert acquired(store, 1, [3]) == [1003.0]  # the prefetched expert, no second copy
    assert sorted(lanes) == [(0.0, False), (1.0, False), (1003.0, True)]
    store.close()


def test_a_prefetch_cancelled_through_the_host_tier_is_loaded_on_demand():
    """Regression (H100, host cache over disk with expert-map prefetch): a prefetch still queued when its layer
    routes is cancelled; its host slot held no expert, yet a demand load found it there and raised the
    cancelled read's CancelledError."""
    store, reader = make_store(4, layers=(0, 1), host=6)
    reader.gate.clear()  # the prefetch lane's one thread blocks on its first read; the second stays queued
    next_pass(store)
    assert store.prefetch(0, [1]) == 1 and store.prefetch(0, [2]) == 1
    store.settle(0, [1, 2])  # (0, 2) is still queued: cancelled, to be loaded on demand
    assert store.counters.current.prefetch_cancelled == 1
    threading.Timer(0.05, reader.gate.set).start()
    assert acquired(store, 0, [1, 2]) == [1.0, 2.0]
    assert consume(store, 0, [2]) == [2.0]
    store.close()
