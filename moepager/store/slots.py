"""One tier's bookkeeping: which expert each slot holds, pins, loads in flight, and whom to evict.

The table owns the invariants; the policy only ranks the candidates it is offered:
- a pinned slot (its expert is being computed with, or is scheduled to be) is never offered;
- a slot whose load (or copy out of it) is still in flight is never offered, so no load is issued twice
  and no buffer is overwritten while a transfer uses it;
- with scope "layer", every MoE layer has a quota of slots (capacity split evenly, or a configured split: MoEpic's
  per-layer budgets) and never holds more: a
  layer at its quota evicts among its own experts even while other layers' slots are free, and when none of
  its own can go the claim fails (so each layer is the fixed-size cache the trace simulator models; the
  store streams an expert that finds no slot through a stream row). With scope "global" all layers compete
  for all slots.
- stream rows (`stream_rows`, after the `capacity` cached slots in the arena) are buffers an expert passes
  through without being cached: the table tracks their pins and transfers, never offers them to a claim.
- which candidate goes is the policy's alone (on the device tier the builder wraps it in the prefetch policy,
  policies/prefetch.py, which puts wrongly prefetched experts first and not-yet-used prefetches last); `on_evict`
  hears of every eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

import torch

from moepager.policies.base import EvictionPolicy
from moepager.types import ExpertKey, Scope

P = TypeVar("P", bound=EvictionPolicy)


def settled(ticket: Future[torch.cuda.Event | None] | None) -> bool:
    """True when a transfer is finished: its job ran (re-raising its error) and its CUDA copy completed."""
    if ticket is None or ticket.cancelled():
        return True
    if not ticket.done():
        return False
    event = ticket.result()
    return event is None or event.query()


class SlotTable(Generic[P]):
    def __init__(self, capacity: int, layers: Sequence[int], policy: P, scope: Scope,
                 stream_rows: int = 0, quotas: Sequence[int] | None = None):
        """`quotas`: scope "layer", each layer's share of the `capacity` slots (default: an even split)."""
        self.capacity = capacity
        self.policy = policy
        self.scope = scope
        self.stream_rows = list(range(capacity, capacity + stream_rows))
        """Rows after the cached slots that experts stream through uncached (the store hands them out)."""
        rows = capacity + stream_rows
        self.slot_of: dict[ExpertKey, int] = {}
        self.pins = [0] * rows
        self.ticket: list[Future[torch.cuda.Event | None] | None] = [None] * rows
        """The transfer in flight into (or out of) each slot or stream row; None once awaited."""
        self.free_event: list[torch.cuda.Event | None] = [None] * rows
        """CUDA: recorded on the compute stream after the slot's expert was last used; copies into it wait."""
        self.by_layer: dict[int, set[ExpertKey]] = {layer: set() for layer in layers}
        n = max(len(layers), 1)
        self.quota = {layer: capacity // n + (i < capacity % n) for i, layer in enumerate(layers)}
        if quotas is not None:
            if len(quotas) != len(layers):
                raise ValueError(f"per-layer quotas {list(quotas)} must give each of the {len(layers)} layers a share "
                                 f"of the {capacity} slots")
            self.quota = self._checked(dict(zip(layers, quotas)))
        self._free = list(range(capacity - 1, -1, -1))
        self.on_evict: Callable[[list[ExpertKey]], None] | None = None
        """Called with the experts each claim evicted (the store judges prefetches with it)."""

    def busy(self) -> Iterable[Future[torch.cuda.Event | None]]:
        return [t for t in self.ticket if t is not None]

    def claim(self, key: ExpertKey, step: int, protect: Container[ExpertKey] = ()) -> int | None:
        """A slot for `key` (free, or freed by evicting a victim other than those in `protect`); None when
        nothing may be evicted. A layer at its quota (scope "layer") evicts one of its own or gets nothing."""
        slots = self.claim_many((key,), step, protect)
        return slots[0] if slots else None

    def claim_many(self, keys: Sequence[ExpertKey], step: int, protect: Container[ExpertKey] = ()) -> list[int]:
        """Slots for `keys` (none resident, all of one layer in scope "layer"), in order: the slots `claim` one key
        after another would give, with one ranking of the candidates for all the evictions. Returns a slot for
        each key of a prefix of `keys`, shorter when nothing more may be evicted."""
        layer = keys[0].layer
        room = len(self._free)
        if self.scope == "layer":
            room = min(room, self.quota[layer] - len(self.by_layer[layer]))  # a layer below quota has free slots
        room = max(room, 0)
        evict = len(keys) - room
        victims = self._victims(layer, evict, step, protect) if evict > 0 else []
        take = min(room, len(keys))  # free slots, from the end of the free list (as pop() one by one)
        slots = self._free[len(self._free) - take:][::-1]
        del self._free[len(self._free) - take:]
        slot_of, by_layer = self.slot_of, self.by_layer
        for victim in victims:
            slot = slot_of.pop(victim)
            by_layer[victim.layer].discard(victim)
            self.ticket[slot] = None
            slots.append(slot)
        if victims and self.on_evict is not None:
            self.on_evict(victims)
        for key, slot in zip(keys, slots):
            slot_of[key] = slot
            by_layer[key.layer].add(key)
        return slots

    def resize(self, quotas: dict[int, int], step: int, keep: Callable[[ExpertKey], bool] | None = None
               ) -> list[ExpertKey]:
        """New per-layer quotas (scope "layer", summing to the capacity), between passes with nothing pinned or in
        flight: experts `keep` refuses are dropped, then every layer above its new quota drops the policy's victims
        down to it (the others keep what they hold). Returns the experts dropped, their slots free again."""
        if self.scope != "layer":
            raise ValueError("per-layer quotas apply to scope 'layer'")
        quotas = self._checked(quotas)
        if any(self.pins[:self.capacity]) or any(not settled(t) for t in self.ticket):
            raise RuntimeError("the cache is resized between passes, with nothing pinned or loading")
        dropped = [k for k in self.slot_of if keep is not None and not keep(k)]
        gone = set(dropped)
        for layer, quota in quotas.items():
            held = [k for k in self.by_layer[layer] if k not in gone]
            if len(held) > quota:
                dropped += self.policy.victims(held, len(held) - quota, step)
        for key in dropped:
            slot = self.slot_of.pop(key)
            self.by_layer[key.layer].discard(key)
            self.ticket[slot] = None
            self._free.append(slot)
        self.quota = quotas
        return dropped

    def _checked(self, quotas: dict[int, int]) -> dict[int, int]:
        """`quotas` when they give every layer a share of the capacity (none negative, all of them used)."""
        if set(quotas) != set(self.by_layer) or sum(quotas.values()) != self.capacity \
                or min(quotas.values(), default=0) < 0:
            raise ValueError(f"per-layer quotas {list(quotas.values())} must give each of the {len(self.by_layer)} "
                             f"layers a share of the {self.capacity} slots")
        return dict(quotas)

    def forget(self, slot: int) -> ExpertKey | None:
        """Drop whatever `slot` holds and return it to the free list (after a failed or cancelled load); returns
        the expert it held."""
        self.ticket[slot] = None
        if slot >= self.capacity:  # a stream row holds nothing cached
            return None
        key = next((k for k, s in self.slot_of.items() if s == slot), None)
        if key is not None:
            del self.slot_of[key]
            self.by_layer[key.layer].discard(key)
        self._free.append(slot)
        return key

    def _victims(self, layer: int, count: int, step: int, protect: Container[ExpertKey]) -> list[ExpertKey]:
        """The policy's first `count` picks (fewer when there are fewer) among the unpinned, settled, unprotected
        experts of `layer` (scope "layer": no layer exceeds its quota, so one below it has a free slot) or of every
        layer."""
        slot_of, pins, tickets = self.slot_of, self.pins, self.ticket
        group: Iterable[ExpertKey] = self.slot_of if self.scope == "global" else self.by_layer[layer]
        candidates = []
        for k in group:
            slot = slot_of[k]
            if pins[slot] == 0 and k not in protect and (tickets[slot] is None or settled(tickets[slot])):
                candidates.append(k)
        return self.policy.victims(candidates, min(count, len(candidates)), step) if candidates else []
