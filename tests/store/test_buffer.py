"""MoEpic's prefetch buffer (store/buffer.py): bottoms of split experts loaded ahead into the free stream rows, computed
from there when their layer routes, given up when it does not, taken back by a layer short of rows."""

from __future__ import annotations

import random
import threading
from concurrent.futures import wait

import pytest

from moepager.errors import CheckpointError
from moepager.store.keyspace import SplitParts
from moepager.types import ExpertKey
from tests.store.test_prefetch_store import JitteryReader
from tests.store.test_store import consume, make_store, value


def bottoms(layer: int, experts, parts: int = 2) -> list[ExpertKey]:
    """The bottom part (the last of `parts`, none cached) of each expert."""
    return [ExpertKey(layer, e * parts + parts - 1) for e in experts]


def test_bottoms_forecast_load_ahead_into_free_stream_rows_and_are_computed_from_there():
    """MoEpic's prefetch of bottom segments (split experts, the top part cached, the bottom streamed): forecast
    bottoms take the free stream rows, the one that finds none waits for one. The layer routes to one of them: the
    others give their rows up, and the routed one is computed from its row, read once, counted a hit loaded ahead."""
    store, reader = make_store(8, streams=2)
    store.use(SplitParts(2, {0: 1, 1: 1}))
    assert store.prefetch_bottoms(bottoms(1, [3, 4, 5])) == 2  # two rows; expert 5's bottom waits for one
    assert set(store.buffer.rows) == set(bottoms(1, [3, 4]))
    store.settle(1, [6, 7, 0, 1])  # layer 1 routes to experts 3 and 0 (both parts of each)
    assert set(store.buffer.rows) == set(bottoms(1, [3])) and store.buffer.wanted == []
    assert consume(store, 1, [6, 7, 0, 1]) == [value(ExpertKey(1, e)) for e in (6, 7, 0, 1)]
    c = store.counters.current
    assert reader.reads.count(ExpertKey(1, 7)) == 1 and ExpertKey(1, 11) not in reader.reads
    assert (c.loads_ahead, c.prefetch_used, c.prefetch_wasted + c.prefetch_cancelled) == (2, 1, 1)
    assert c.hits[1] == 1 and c.misses[1] == 3  # the bottom loaded ahead; tops 6, 0 and bottom 1 on demand
    assert store.buffer.rows == {} and all(p == 0 for p in store.device.table.pins)
    store.close()


def test_a_layer_short_of_stream_rows_takes_them_back_from_bottoms_loaded_ahead_for_another_layer():
    """Both stream rows hold bottoms forecast for layer 1 (one reading, one queued behind it) when layer 0 needs two
    bottoms: the queued one is cancelled, the reading one awaited, and layer 0 gets its rows and its own values."""
    store, reader = make_store(8, streams=2)
    store.use(SplitParts(2, {0: 1, 1: 1}))
    reader.gate.clear()
    assert store.prefetch_bottoms(bottoms(1, [3, 4])) == 2
    threading.Timer(0.1, reader.gate.set).start()
    assert consume(store, 0, [0, 1, 2, 3]) == [value(ExpertKey(0, e)) for e in range(4)]
    c = store.counters.current
    assert store.buffer.rows == {} and c.prefetch_cancelled == 1 and c.prefetch_wasted == 1
    assert all(p == 0 for p in store.device.table.pins)
    store.close()


@pytest.mark.parametrize("host", [None, 20], ids=["disk", "host-tier"])
@pytest.mark.parametrize("seed", range(4))
def test_split_experts_hold_their_own_weights_while_bottoms_loaded_ahead_race_demand_loads(seed, host):
    """Split experts (three parts, one or two cached per layer) over random layers and forecasts of tops and bottoms,
    right or wrong, settled as the engine does, loads of random duration: every part computed holds its own values,
    and at the end only the rows of bottoms still ahead are pinned."""
    store, _ = make_store(12, layers=(0, 1, 2), reader=JitteryReader(seed), io_threads=2, streams=3, host=host)
    store.use(SplitParts(3, {0: 1, 1: 2, 2: 1}))
    rng = random.Random(seed)
    for _ in range(60):
        layer = rng.randrange(3)
        experts = sorted(rng.sample(range(6), rng.randint(1, 2)))
        target = (layer + 1) % 3
        forecast = rng.sample(range(6), rng.randint(0, 3))
        store.prefetch(target, [e * 3 + j for e in forecast for j in range(store.space.tops[target])])
        store.prefetch_bottoms([ExpertKey(target, e * 3 + j) for e in forecast
                                for j in range(store.space.tops[target], 3)])
        parts = [e * 3 + j for e in experts for j in range(3)]
        store.settle(layer, parts)
        assert consume(store, layer, parts) == [value(ExpertKey(layer, p)) for p in parts]
    store._drain(store.device.table)
    c = store.counters.current
    assert c.prefetch_used > 0 and c.prefetch_wasted + c.prefetch_cancelled > 0
    pins = store.device.table.pins
    assert [pins[r] for r in store.device.table.stream_rows] == [
        int(r in store.buffer.rows.values() or any(r == d for d, _ in store.buffer.dropping))
        for r in store.device.table.stream_rows]
    assert all(p == 0 for p in pins[: store.device.table.capacity])
    store.close()


def test_bottoms_forecast_between_a_layers_routing_and_its_demand_loads_wait_for_them():
    """MoEpic prefetches for layer i+1 once layer i's missing pieces are on their way: bottoms forecast after layer 1
    routed (as the engine forecasts, before the layer acquires) issue nothing until its demand loads took their rows;
    then they take the row left free, and layer 1 never takes rows back from them."""
    store, reader = make_store(8, streams=2)
    store.use(SplitParts(2, {0: 1, 1: 1}))
    store.settle(1, [2, 3])
    assert store.prefetch_bottoms(bottoms(0, [4, 5])) == 0 and store.buffer.rows == {}
    held = store.acquire(1, [2, 3])  # expert 1's top on demand into the cache, its bottom into a stream row
    assert set(store.buffer.rows) == set(bottoms(0, [4]))  # the other row, after the demand loads
    store.wait(held, range(2))
    assert [float(store.device.buffers[slot][0]) for slot in held.slots] == [value(ExpertKey(1, e)) for e in (2, 3)]
    store.release(held)  # its row: expert 5's bottom
    assert set(store.buffer.rows) == set(bottoms(0, [4, 5]))
    assert store.counters.current.prefetch_cancelled + store.counters.current.prefetch_wasted == 0
    store.close()


def test_a_bottom_whose_read_ahead_failed_troubles_no_one_unless_its_layer_routes_to_it():
    """A read ahead that fails (a corrupt file, say) is over, not in flight; a layer that does not route to it never
    hears of it, and one that does gets the read's error, as from a demand load."""
    store, reader = make_store(8, streams=2)
    store.use(SplitParts(2, {0: 1, 1: 1}))
    reader.fail.add(ExpertKey(1, 7))
    assert store.prefetch_bottoms(bottoms(1, [3])) == 1
    wait([store.device.table.ticket[store.buffer.rows[ExpertKey(1, 7)]]])
    assert store.loading_ahead() == []
    store.settle(1, [0, 1])  # not expert 3
    assert consume(store, 1, [0, 1]) == [value(ExpertKey(1, 0)), value(ExpertKey(1, 1))]
    assert store.prefetch_bottoms(bottoms(1, [3])) == 1
    store.settle(1, [6, 7])
    with pytest.raises(CheckpointError):
        consume(store, 1, [6, 7])
    store.close()
