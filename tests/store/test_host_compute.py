"""The store's host tier as hybrid execution uses it (store/host_compute.py): misses pinned in host slots to be
computed there, read from disk when absent, and admitted to the device afterwards."""

from __future__ import annotations

import pytest

from moepager.store.host_compute import HostCompute
from moepager.types import ExpertKey
from tests.store.test_store import make_store, value


def test_misses_are_pinned_in_the_host_tier_read_once_and_admitted_to_the_device():
    store, reader = make_store(4, host=6)
    host = HostCompute(store)
    held = host.acquire(1, [2, 3])
    for read in held.reads:
        assert read is not None
        read.result()
    assert [float(store.host.buffers[slot][0]) for slot in held.slots] == [value(ExpertKey(1, e)) for e in (2, 3)]
    assert all(store.host.table.pins[slot] == 1 for slot in held.slots)
    c = store.counters.current
    assert (c.misses[1], c.on_cpu) == (2, 2) and not host.on_device(ExpertKey(1, 2))
    host.release(held)
    assert all(p == 0 for p in store.host.table.pins)
    again = host.acquire(1, [2])  # in the host tier now: not read again
    assert again.reads == [None] and reader.reads.count(ExpertKey(1, 2)) == 1
    host.release(again)
    assert host.admit(1, [2, 3]) == 2
    store._drain(store.device.table)
    assert host.on_device(ExpertKey(1, 2)) and host.on_device(ExpertKey(1, 3))
    store.close()


def test_a_store_without_a_host_tier_is_refused():
    store, _ = make_store(4)
    with pytest.raises(ValueError, match="host tier"):
        HostCompute(store)
    store.close()
