"""MoEpic's prefetch buffer (§2.2, steps 6-9): bottom parts of split experts loaded ahead into the stream rows.

A split checkpoint's layer caches the top parts of its experts and streams their bottom parts through the store's
stream rows (store/store.py). The rows a layer's own demand loads leave free are MoEpic's prefetch buffer: the bottoms
of the experts forecast for the next layers (best first) load into them ahead of time and wait there until their
layer routes. Algorithm:
1. `want(keys)`: the forecast bottoms replace the last list; as many as there are free rows start loading (on the
   prefetch lane, one contiguous read per expert's bottom), each row pinned; the rest wait for a row. Between a
   layer's routing and its demand loads nothing is issued: MoEpic prefetches for layer i+1 only once layer i's missing
   pieces are on their way (`after_demand`).
2. A row comes free when a layer is done with it (`recycle`, `release`) or a dropped bottom's read has ended; a layer's
   own queued misses take a freed row first, the wanted bottoms then (`issue`).
3. The layer routes (`settle`): its wanted bottoms not yet loading are dropped (demand loads them now), its bottoms
   loaded ahead that it does not need give their rows up (cancelled if their read never started, else once it ends).
4. The layer fills (`take`): each routed bottom loaded ahead is computed from its row (read once: a hit loaded
   ahead). A layer that needs rows and finds too few free takes them back from bottoms loaded ahead for other layers
   (`reclaim`), so a layer never waits for rows it cannot get.
Outputs never change: a bottom is computed from whichever row holds it, loaded ahead or on demand.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import Protocol

from moepager.store.slots import settled
from moepager.store.stats import PhaseCounters, StoreCounters
from moepager.store.tiers import Held, Ticket, Tier
from moepager.store.transfer import Transfers
from moepager.types import ExpertKey


class BufferedStore(Protocol):
    """What the buffer uses of its store (store/store.py `ExpertStore`): the device tier's stream rows, pins and
    tickets, the counters, the transfers, and three hooks."""

    device: Tier
    counters: StoreCounters
    transfers: Transfers

    def unpin(self, slots: Sequence[int]) -> None:
        """The compute stream is done with `slots`."""

    def load_into(self, keys: Sequence[ExpertKey], slots: Sequence[int], counters: PhaseCounters,
                  ahead: bool) -> None:
        """Start loading `keys` into the device `slots`."""

    def forget_cancelled_host_read(self, ticket: Ticket) -> None:
        """A cancelled prefetch's host slot is freed."""


class PrefetchBuffer:
    def __init__(self, store: BufferedStore):
        self.store = store
        self.rows: dict[ExpertKey, int] = {}
        """Bottoms loaded ahead (or loading): key -> its stream row, pinned until its layer routes."""
        self.wanted: list[ExpertKey] = []
        """Forecast bottoms, best first, waiting for a free row."""
        self.dropping: list[tuple[int, Ticket]] = []
        """Rows of bottoms loaded ahead for nothing whose read had started: free once it has ended."""
        self.routed: int | None = None
        """The layer that has routed and not yet issued its demand loads (nothing is issued ahead of them)."""

    def free_rows(self) -> list[int]:
        """Stream rows no layer and no load ahead is using (a dropped bottom's row once its read has ended)."""
        if self.dropping:
            still = []
            for row, ticket in self.dropping:
                if _ended(ticket):
                    self._free(row)
                else:
                    still.append((row, ticket))
            self.dropping = still
        table = self.store.device.table
        pins = table.pins
        return [row for row in table.stream_rows if pins[row] == 0]

    def _free(self, row: int) -> None:
        """`row` holds nothing loaded ahead any more: no transfer, no pin."""
        self.store.device.table.ticket[row] = None
        self.store.unpin([row])

    def want(self, keys: Sequence[ExpertKey]) -> int:
        """Step 1; returns the loads issued now."""
        self.wanted = [k for k in keys if k not in self.rows]
        return self.issue() if self.routed is None else 0

    def after_demand(self) -> None:
        """The routed layer's demand loads are issued: wanted bottoms may take the rows it left free."""
        self.routed = None
        if self.wanted:
            self.issue()

    def issue(self) -> int:
        """Wanted bottoms into the free rows; returns the loads issued."""
        rows = self.free_rows()
        if not rows or not self.wanted:
            return 0
        take, self.wanted = self.wanted[: len(rows)], self.wanted[len(rows):]
        rows = rows[: len(take)]
        pins = self.store.device.table.pins
        for key, row in zip(take, rows):
            pins[row] += 1
            self.rows[key] = row
        self.store.load_into(take, rows, self.store.counters.current, ahead=True)
        return len(take)

    def settle(self, layer: int, needed: set[int]) -> None:
        """Step 3: `layer` routed to the parts `needed`."""
        self.routed = layer
        if self.wanted:
            self.wanted = [k for k in self.wanted if k.layer != layer]
        for key in [k for k in self.rows if k.layer == layer and k.expert not in needed]:
            self.drop(key)

    def take(self, held: Held, keys: Sequence[ExpertKey], bottoms: list[int]) -> list[int]:
        """Step 4: the bottoms (indices into keys) loaded ahead are computed from their rows (each row's pin passes to
        `held`); returns the others."""
        if not self.rows:
            return bottoms
        store = self.store
        counters, tickets, rest = store.counters.current, store.device.table.ticket, []
        for i in bottoms:
            row = self.rows.pop(keys[i], -1)
            if row < 0:
                rest.append(i)
                continue
            held.slots[i] = row
            held.streaming += 1
            if (ticket := tickets[row]) is not None and not ticket.done():
                store.transfers.promote(ticket)  # it stops giving way to the layer's demand loads
            counters.misses[held.layer] -= 1  # a hit loaded ahead, as a prefetched cached expert is
            counters.hits[held.layer] += 1
            counters.prefetch_used += 1
        return rest

    def rows_for(self, layer: int, queued: int) -> list[int]:
        """Step 4: the free stream rows for `layer`'s `queued` units, after taking back those that bottoms loaded
        ahead for other layers hold when too few are free (`reclaim`)."""
        if self.rows or self.dropping:
            self.reclaim(layer, queued)
        return self.free_rows()

    def reclaim(self, layer: int, queued: int) -> None:
        """Step 4: `layer` has `queued` parts waiting for rows and finds too few free: bottoms loaded ahead for other
        layers give theirs up (a read that started is awaited)."""
        if len(self.free_rows()) >= min(queued, len(self.store.device.table.stream_rows)):
            return
        for key in [k for k in self.rows if k.layer != layer]:
            self.drop(key)
        for _, ticket in self.dropping:
            with suppress(Exception):  # a read for nothing that failed or was cancelled: its row is free all the same
                if (event := ticket.result()) is not None:
                    event.synchronize()
        self.free_rows()

    def drop(self, key: ExpertKey) -> None:
        """A bottom loaded ahead is not needed: its row is free at once if its read never starts or has ended, else
        once it ends."""
        store = self.store
        row = self.rows.pop(key)
        ticket, counters = store.device.table.ticket[row], store.counters.current
        if ticket is not None and not ticket.done() and (ticket.cancel() or store.transfers.abandon(ticket)):
            counters.prefetch_cancelled += 1  # it never reads a byte
            store.forget_cancelled_host_read(ticket)
        else:
            counters.prefetch_wasted += 1
            if ticket is not None and not _ended(ticket):
                self.dropping.append((row, ticket))
                return
        self._free(row)

    def clear(self) -> None:
        """Drop everything (between passes, every transfer awaited: a reconfiguration may make a bottom a top)."""
        for key in list(self.rows):
            self.drop(key)
        self.wanted = []
        self.free_rows()

    def loading(self) -> list[ExpertKey]:
        """Bottoms loaded ahead whose read is still in flight (one that failed is over: its layer hears of it)."""
        tickets = self.store.device.table.ticket
        return [k for k, row in self.rows.items() if tickets[row] is not None and not _ended(tickets[row])]


def _ended(ticket: Ticket) -> bool:
    """Whether a transfer is over, whether it loaded or failed (a load ahead for nothing: its error is nobody's)."""
    try:
        return settled(ticket)
    except Exception:  # noqa: BLE001 - the read failed: it is over
        return True
