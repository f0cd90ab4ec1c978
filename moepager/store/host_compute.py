"""The store's host tier as hybrid execution uses it (experts/hybrid.py, SMoE): a layer's misses computed where they
are, in host-tier slots on the CPU, instead of copied to the device; and, with `--hybrid-admit`, copied to the device
in the background once computed.

Every operation goes through the store's tables and transfer lanes (store/store.py), so its invariants hold: a pinned
slot is never evicted, a slot with a transfer in flight is never reused, and the policies see every access.
"""

from __future__ import annotations

from collections.abc import Sequence

from moepager.store.slots import settled
from moepager.store.store import ExpertStore
from moepager.store.tiers import HostHeld, Ticket
from moepager.types import ExpertKey


class HostCompute:
    def __init__(self, store: ExpertStore):
        if store.host is None:
            raise ValueError("hybrid execution computes misses in the host tier, and this store has none")
        self.store = store

    def on_device(self, key: ExpertKey) -> bool:
        """Whether `key` is in a device slot (landed, or loading: a layer then waits for it, SMoE's wait_cache)."""
        return key in self.store.device.table.slot_of

    def acquire(self, layer: int, experts: Sequence[int]) -> HostHeld:
        """Pin host-tier slots holding `experts` of `layer`, which hybrid execution computes there on the CPU
        instead of copying them to the device: each one not in the host tier is read from disk into a slot the host
        tier's policy frees (the demand lane). They count as device misses computed on the CPU, and the device
        tier's policy sees their access (SMoE's LFU counts every activated expert). Wait for `reads` before
        computing (any thread); `release` when done (this thread)."""
        store = self.store
        host = store.host
        assert host is not None
        table, counters = host.table, store.counters.current
        keys = [ExpertKey(layer, e) for e in experts]
        store.device.table.policy.on_access(keys, store.clock)
        table.policy.on_access(keys, store.clock)
        counters.misses[layer] += len(keys)
        counters.on_cpu += len(keys)
        held = HostHeld(layer, [], [])
        try:
            for key in keys:
                slot = table.slot_of.get(key)
                read: Ticket | None = None
                if slot is None:
                    slot = store.claim(table, key)
                    if slot is None:
                        raise RuntimeError(f"expert store: no host slot can be freed for {key} (capacity "
                                           f"{table.capacity}, all in use)")
                    read = store.transfers.submit(store.disk_job, key, host.buffers[slot], counters)
                    table.ticket[slot] = read
                elif not settled(table.ticket[slot]):
                    read = table.ticket[slot]  # a read (or a copy out of it) in flight: its expert lands first
                    store.transfers.promote(read)  # a prefetch's read must not give way to demand loads now
                table.pins[slot] += 1
                held.slots.append(slot)
                held.reads.append(read)
        except BaseException:
            self.release(held)
            raise
        return held

    def admit(self, layer: int, experts: Sequence[int], protect: Sequence[int] = ()) -> int:
        """Copy `experts` of `layer`, just computed in the host tier, into device slots in the background (hybrid
        execution's `--hybrid-admit`): loads on the prefetch lane, each evicting by the policy among the layer's
        settled, unpinned experts other than `protect` (the layer's device experts, which it just used, as the
        simulator protects a step's requests); those that find no slot are skipped. Returns loads issued."""
        store = self.store
        table = store.device.table
        keys = [ExpertKey(layer, e) for e in experts if ExpertKey(layer, e) not in table.slot_of]
        if not keys:
            return 0
        slots = table.claim_many(keys, store.clock, {ExpertKey(layer, e) for e in protect})
        if slots:
            store.load_into(keys[: len(slots)], slots, store.counters.current, ahead=True)
        return len(slots)

    def release(self, held: HostHeld) -> None:
        assert self.store.host is not None
        pins = self.store.host.table.pins
        for slot in held.slots:
            pins[slot] -= 1
        held.slots = []
