"""The expert store: experts paged into a fixed set of device slots from a host tier or from disk.

Tiers: `device` slots are where experts are computed (GPU memory, or RAM on a CPU run); below them either a
`host` tier (pinned RAM slots, which hold every expert or a budget of them, themselves filled from disk) or
disk directly (a CPU run: the host *is* the device). Every slot is one flat preallocated buffer holding all
projections of one expert (a row of one arena tensor per tier); nothing is allocated while decoding.

`acquire(layer, experts)` is what a MoE layer calls (experts/executor.py). Algorithm: pin the hits first, so no miss
evicts them; the misses then claim slots the layer may fill (its quota in scope "layer", any slot in scope "global")
all at once, evicting by one ranking of the policy among the experts the layer does not need (the victims claims one
after another would pick), and start loading (on the I/O pool / copy stream). A layer needing more experts than its
cache holds (a prefill, a large batch) keeps the first misses that fit, in the order asked for, and streams the rest
through the stream rows, buffers outside the cache that an expert passes through uncached: loads into them start at
once and each row takes the next miss when its expert has been computed (`recycle`). So a layer never takes another
layer's slots, and the cache ends each layer exactly as the trace simulator's (tests/trace/test_agreement.py). Every
slot stays pinned until `release`, so an expert in use is never evicted, and a slot loading or being copied out of
is never reused, so no load is issued twice.

Prefetch (`prefetch`, fed by runtime/prefetch.py): loads issued ahead go to the transfer engine's prefetch
lane and are tracked as `ahead` by the device tier's prefetch policy (policies/prefetch.py, composed around its
eviction policy by placements/stores.py) until their layer routes. Prefetches never evict each other, nor (when the
policy protects the forecast) a resident expert the forecast that asked for them names. When a layer's real routing
arrives, `settle` carries out the policy's verdict on each of that layer's prefetches: cancel one still queued,
abandon one waiting on the lane to start, promote one loading (it stops giving way to demand loads:
store/transfer.py), mark one stale (evicted before any expert that was used) or release it. Prefetched experts
occupy the same slots, so they count against the same budget.

Split experts (MoEpic): the store is handed a key space (store/keyspace.py) saying what its keys name, whole experts
or the parts of split ones, which of them its cache may hold (those it never holds stream through the stream rows,
`never_cached`), and which load in one read (`runs`); a key space whose rows no layer is using load units ahead gives
the store its prefetch buffer (store/buffer.py). The store itself knows nothing else of parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, as_completed, wait

import torch

from moepager.policies.base import EvictionPolicy
from moepager.policies.prefetch import PrefetchAware
from moepager.store.buffer import PrefetchBuffer
from moepager.store.keyspace import WHOLE, KeySpace
from moepager.store.slots import SlotTable, settled
from moepager.store.stats import PhaseCounters, StoreCounters
from moepager.store.tiers import Held, ReadExpert, ReadExperts, Ticket, Tier
from moepager.store.transfer import Transfers, completed
from moepager.types import Between, ExpertKey, PassInfo


class ExpertStore:
    def __init__(self, device: Tier[PrefetchAware], host: Tier[EvictionPolicy] | None, read: ReadExpert,
                 transfers: Transfers, read_buffer_bytes: int = 0, read_many: ReadExperts | None = None,
                 space: KeySpace = WHOLE):
        """`device`'s policy: the prefetch policy the builder wraps around its eviction policy (policies/prefetch.py
        make_prefetch_policy). `read_many`: a reader of units lying together on disk in one request, used for the key
        space's `runs` (None: one read each)."""
        self.device, self.host = device, host
        self.order = device.table.policy
        """The device tier's prefetch policy: its eviction order with prefetched experts, and their verdicts."""
        self.priority = self.order.priority
        """How the prefetcher ranks queued prefetches (the prefetch policy's rule; store/view.py `StoreView`)."""
        device.table.on_evict = self._evicted
        self.read_buffer_bytes = read_buffer_bytes
        """Bytes the reading threads take for bounce/conversion buffers (inside the budget of the tier they fill)."""
        self.read = read
        self.read_many = read_many
        self.read_runs: ReadExperts | None = None
        """`read_many` where the key space's units lie together in runs (`use`), else None."""
        self.transfers = transfers
        self.counters = StoreCounters()
        self.clock = 0
        """The current pass (`begin_pass`: the engine's pass id + 1): the `step` policies are given."""
        self.space: KeySpace = WHOLE
        """What the keys name (store/keyspace.py): whole experts, or parts of split ones (`use`)."""
        self.buffer: PrefetchBuffer | None = None
        """Units loaded ahead into the stream rows no layer is using (MoEpic's prefetch buffer of bottom parts;
        `prefetch_bottoms`), where the key space has one."""
        self.use(space)

    def occupancy(self) -> tuple[int, int]:
        """(device slots holding an expert, device cache slots)."""
        table = self.device.table
        return len(table.slot_of), table.capacity

    def layers(self) -> list[int]:
        """The MoE layers the store pages, in order."""
        return list(self.device.table.by_layer)

    # -- filling at start -------------------------------------------------------------------------------
    def warm(self, keys: Sequence[ExpertKey], progress: Callable[[int], None] | None = None) -> None:
        """Load `keys` into free slots before any request: the host tier from disk (on the I/O pool), then the
        device tier from the host tier, or from disk when there is none (a CPU run)."""
        nbytes = self.device.expert_nbytes
        if self.host is not None:
            reads = [self.transfers.submit(self.read, key, self.host.buffers[self.host.table.claim(key, 0)])
                     for key in keys[: self.host.table.capacity]]
        else:
            reads = [self.transfers.submit(self.read, key, self.device.buffers[self.device.table.claim(key, 0)])
                     for key in keys[: self.device.table.capacity]]
        for done in as_completed(reads):
            done.result()
            if progress is not None:
                progress(nbytes)
        if self.host is not None:
            for key in keys[: self.device.table.capacity]:
                src = self.host.table.slot_of.get(key)
                if src is None:
                    break  # a host tier smaller than the device tier: the rest fill on demand
                self.device.buffers[self.device.table.claim(key, 0)].copy_(self.host.buffers[src])
                if progress is not None:
                    progress(nbytes)

    # -- the hot path -----------------------------------------------------------------------------------
    def begin_pass(self, info: PassInfo) -> None:
        """The engine starts a forward pass: its id is the clock policies rank by (they count passes, not layers),
        its phase picks the counters."""
        self.clock = info.pass_id + 1
        self.counters.set_phase(info.phase)

    def acquire(self, layer: int, experts: Sequence[int], cache: bool = True) -> Held:
        """Pin slots holding `experts` of `layer`: hits are pinned first, so no miss evicts them; then the misses,
        in the order given, claim the slots the layer may still fill (its quota, or the whole tier in scope
        "global", less its hits) and start loading; the misses beyond those (a prefill or a large batch needing
        more experts than the layer's cache holds) stream through the stream rows, uncached, each row reused
        once `recycle` hears its expert was computed. `cache` False (SMoE's prefill, experts/hybrid.py): every miss
        streams and no cached expert is evicted (where the tier has stream rows; without them it holds every
        expert, so nothing is evicted either). The ready experts may be computed at once; `wait` or
        `wait_landed` for the pending ones; `release` when the layer is done."""
        table, pins, slot_of = self.device.table, self.device.table.pins, self.device.table.slot_of
        keys, slots, misses = [], [], []
        held = Held(layer, experts, slots, [], [], [])
        try:  # loops, no comprehensions or helpers where a hit needs none: this runs per layer and token
            for i, e in enumerate(experts):
                key = ExpertKey(layer, e)
                keys.append(key)
                slot = slot_of.get(key, -1)
                slots.append(slot)
                if slot >= 0:
                    pins[slot] += 1  # hits are pinned first, so no miss evicts them
                else:
                    misses.append(i)
            table.policy.on_access(keys, self.clock)
            counters = self.counters.current
            if len(misses) < len(keys):
                counters.hits[layer] += len(keys) - len(misses)
            if misses:
                counters.misses[layer] += len(misses)
                self._fill(held, keys, misses, cache)
            buffer = self.buffer
            if buffer is not None:  # rows the layer leaves free take forecast bottoms (MoEpic: after the demand loads)
                buffer.after_demand()
            if self.order.ahead or self.order.stale:
                hit = [k for i, k in enumerate(keys) if i not in misses] if misses else keys
                counters.prefetch_used += self.order.used(hit)
            for i, slot in enumerate(slots):
                if slot < 0:
                    continue
                ticket = table.ticket[slot]
                if ticket is None:
                    held.ready.append(i)
                elif ticket.done():
                    self._wait_ready(slot)  # landed: its result is claimed now (a failed read raises here)
                    held.ready.append(i)
                else:
                    held.pending.append(i)
        except BaseException:
            self.release(held)
            raise
        return held

    def _fill(self, held: Held, keys: Sequence[ExpertKey], misses: Sequence[int], cache: bool = True) -> None:
        """`acquire`'s misses (indices into keys): those that fit the layer's cache claim slots and load together
        (one ranking of the candidates, one submission), the rest queue for the stream rows (all of them when not
        `cache` and there are stream rows)."""
        table, slots, layer = self.device.table, held.slots, held.layer
        hits = len(keys) - len(misses)
        room = (table.quota[layer] if table.scope == "layer" else table.capacity) - hits
        if not cache and table.stream_rows:
            room = 0
        streamed: list[int] = []
        if layer in self.space.streaming:  # units the cache never holds (a split layer's bottoms) always stream
            misses, streamed = self.space.never_cached(keys, misses)
            buffer = self.buffer
            if buffer is not None:  # those loaded ahead are computed from the rows they wait in
                streamed = buffer.take(held, keys, streamed)
        if len(misses) + len(streamed) > room and not table.stream_rows:
            raise RuntimeError(f"expert store: layer {layer} needs {len(keys)} experts at once but holds "
                               f"{room + hits} and has no stream rows")
        cached, drained = misses[: max(room, 0)], False
        while cached:  # claimed, loading and pinned before any wait: a claimed slot never sits empty and unpinned
            wanted = list(map(keys.__getitem__, cached))
            got = table.claim_many(wanted, self.clock)
            self.load_into(wanted[: len(got)], got, self.counters.current, ahead=False)
            for i, slot in zip(cached, got):
                slots[i] = slot
                table.pins[slot] += 1
            cached = cached[len(got):]
            if cached and drained:
                raise RuntimeError(f"expert store: no device slot can be freed for {wanted[len(got)]} "
                                   f"(capacity {table.capacity})")
            if cached:  # only loads in flight stand in the way: wait for them, then claim the rest
                self._drain(table)
                drained = True
        held.queued = sorted(misses[max(room, 0):] + streamed) if streamed else list(misses[max(room, 0):])
        rows, buffer = table.stream_rows, self.buffer  # all free, unless units loaded ahead hold some (store/buffer.py)
        if buffer is not None and held.queued:
            rows = buffer.rows_for(layer, len(held.queued))
        rows = rows[: len(held.queued)]
        if rows:  # the first queued misses into the stream rows, submitted together (a run of units: one read)
            started = [self._stream_start(held, row) for row in rows]
            keys = [ExpertKey(layer, held.experts[i]) for i in started]
            self.load_into(keys, rows, self.counters.current, ahead=False)

    def _stream_next(self, held: Held, row: int) -> int:
        """The next queued miss of `held` starts loading into stream `row` (pinned); returns its index."""
        i = self._stream_start(held, row)
        self.load_into([ExpertKey(held.layer, held.experts[i])], [row], self.counters.current, ahead=False)
        return i

    def _stream_start(self, held: Held, row: int) -> int:
        """The next queued miss of `held` takes stream `row` (pinned; its load not yet issued); returns its index."""
        i = held.queued.pop(0)
        held.slots[i] = row
        held.streaming += 1
        self.device.table.pins[row] += 1
        return i

    def recycle(self, held: Held, computed: Iterable[int]) -> list[int]:
        """The experts `computed` (indices into held.slots) are done with: each stream row among their slots
        takes the next queued miss. Returns the indices that started loading (add them to those awaited)."""
        started = []
        for i in computed:
            row = held.slots[i]
            if row < self.device.table.capacity:
                continue
            self.unpin([row])
            held.slots[i] = -1
            held.streaming -= 1
            if held.queued:
                started.append(self._stream_next(held, row))
        buffer = self.buffer
        if buffer is not None and buffer.wanted and not held.queued:
            buffer.issue()
        return started

    def wait(self, held: Held, which: Iterable[int]) -> None:
        """Block until the slots `which` (indices into held.slots) hold their experts."""
        tickets, slots = self.device.table.ticket, held.slots
        for i in which:
            if tickets[slots[i]] is not None:  # landed and already awaited: nothing to do (most hits)
                self._wait_ready(slots[i])

    def wait_landed(self, held: Held, which: Sequence[int]) -> list[int]:
        """Block until at least one of the slots `which` (indices into held.slots) holds its expert; returns
        every one that does, each claimed as `wait` claims it (so a caller computes whatever landed first)."""
        tickets, slots = self.device.table.ticket, held.slots
        loading = []
        for i in which:
            if (t := tickets[slots[i]]) is not None and not t.done():
                loading.append(t)
        if which and len(loading) == len(which):
            start = time.perf_counter()
            wait(loading, return_when=FIRST_COMPLETED)
            self.counters.current.exposed_s += time.perf_counter() - start
        landed = []
        for i in which:
            if (t := tickets[slots[i]]) is None or t.done():
                landed.append(i)
        self.wait(held, landed)
        return landed

    def release(self, held: Held) -> None:
        self.unpin(held.slots)
        held.slots, held.queued = [], []
        buffer = self.buffer
        if buffer is not None and buffer.wanted:
            buffer.issue()

    def stream(self, layer: int, experts: Sequence[int]) -> Iterator[int]:
        """Device slots (or stream rows) holding `experts` of `layer`, one by one in order (`acquire`'s pins
        held until the last is consumed)."""
        held = self.acquire(layer, experts)
        try:
            for i in range(len(experts)):
                self._wait_ready(held.slots[i])
                yield held.slots[i]
                self.recycle(held, [i])
        finally:
            self.release(held)

    def claim(self, table: SlotTable, key: ExpertKey) -> int | None:
        """A slot for `key`, awaiting the loads in flight when only they stand in the way."""
        slot = table.claim(key, self.clock)
        if slot is None:
            self._drain(table)
            slot = table.claim(key, self.clock)
        return slot

    def _evicted(self, keys: list[ExpertKey]) -> None:
        self.counters.current.prefetch_wasted += self.order.forget(keys)  # prefetches evicted before they ran

    def _wait_ready(self, slot: int) -> None:
        table = self.device.table
        ticket = table.ticket[slot]
        if ticket is None:
            return
        if not ticket.done():
            start = time.perf_counter()
            wait([ticket])
            self.counters.current.exposed_s += time.perf_counter() - start
        try:
            event = ticket.result()  # re-raises a failed read (e.g. the checkpoint changed on disk)
        except BaseException:
            self._forget(slot)  # the slot holds no valid expert: a retry must read it again
            raise
        if event is not None:
            torch.cuda.current_stream(self.device.buffers.device).wait_event(event)
        table.ticket[slot] = None

    def unpin(self, slots: Sequence[int]) -> None:
        """The compute stream is done with `slots` (those >= 0; on CUDA one event, recorded now, guards them
        all)."""
        table = self.device.table
        for slot in slots:
            if slot >= 0:
                table.pins[slot] -= 1
        if self.device.buffers.is_cuda and any(slot >= 0 for slot in slots):
            event = torch.cuda.current_stream(self.device.buffers.device).record_event()
            for slot in slots:
                if slot >= 0:
                    table.free_event[slot] = event

    # -- the key space and reconfiguration (MoEpic) ----------------------------------------------------------
    def use(self, space: KeySpace) -> None:
        """Keys name `space`'s units from here on (store/keyspace.py; before any is loaded, or by `reconfigure`)."""
        if space.streaming and not self.device.table.stream_rows:
            raise ValueError("units the cache never holds (split experts' bottom parts) stream: the store needs "
                             "stream rows")
        self.space = space
        self.read_runs = self.read_many if space.runs_together else None
        if space.buffered and self.buffer is None:
            self.buffer = PrefetchBuffer(self)

    def reconfigure(self, quotas: dict[int, int], tops: dict[int, int] | None = None) -> int:
        """New per-layer cache sizes (scope "layer"; their sum the cache's capacity) and, for split experts, top parts
        per layer (`KeySpace.with_tops`), between passes (nothing pinned): in-flight loads are awaited, every cached
        unit the key space no longer caches is dropped and every layer above its new quota evicts by its policy down
        to it. Cached units that stay are kept, so the change reads nothing. Returns the units dropped."""
        table = self.device.table
        self._drain(table)
        if self.buffer is not None:
            self.buffer.clear()  # a bottom may be a top now: loads ahead start again from the next forecast
        if tops is not None:
            self.use(self.space.with_tops(tops))
        dropped = table.resize(quotas, self.clock, self.space.cacheable)
        if dropped:
            self._evicted(dropped)
        return len(dropped)

    # -- loading ----------------------------------------------------------------------------------------
    def load_into(self, keys: Sequence[ExpertKey], slots: Sequence[int], counters: PhaseCounters, ahead: bool) -> None:
        """Start loading `keys` into the device `slots` (each slot's ticket marks its load)."""
        if ahead:
            counters.loads_ahead += len(keys)
        else:
            counters.loads_on_demand += len(keys)
        table, buffers, issued = self.device.table, self.device.buffers, time.perf_counter()
        if self.read_runs is not None and self.host is None and len(keys) > 1:  # units lying together: one read
            runs = self.space.runs(keys)
            calls = [([keys[i] for i in run], [buffers[slots[i]] for i in run], counters, issued) for run in runs]
            for run, ticket in zip(runs, self.transfers.submit_all(self._disk_load_run, calls, ahead)):
                for i in run:
                    table.ticket[slots[i]] = ticket
            return
        if self.host is None:  # one submission for the lot; each job times its own load (on its thread)
            calls = []
            for key, slot in zip(keys, slots):
                calls.append((key, buffers[slot], counters, issued))
            for slot, ticket in zip(slots, self.transfers.submit_all(self._disk_load, calls, ahead)):
                table.ticket[slot] = ticket
            return
        for key, slot in zip(keys, slots):
            ticket = self._via_host(key, buffers[slot], table.free_event[slot], counters, ahead)
            ticket.add_done_callback(lambda t: None if t.cancelled() or self.transfers.abandoned(t)  # loaded nothing
                                     else counters.loaded(issued, time.perf_counter()))
            table.ticket[slot] = ticket

    def _disk_load(self, key: ExpertKey, dst: torch.Tensor, counters: PhaseCounters, issued: float,
                   between: Between | None = None) -> None:
        self.disk_job(key, dst, counters, between)
        counters.loaded(issued, time.perf_counter())

    def _disk_load_run(self, keys: Sequence[ExpertKey], dsts: Sequence[torch.Tensor], counters: PhaseCounters,
                       issued: float, between: Between | None = None) -> None:
        assert self.read_runs is not None
        start = time.perf_counter()
        nbytes = self.read_runs(keys, dsts, between)
        done = time.perf_counter()
        counters.disk_read(nbytes, start, done)
        for _ in keys:
            counters.loaded(issued, done)

    def disk_job(self, key: ExpertKey, dst: torch.Tensor, counters: PhaseCounters,
                  between: Between | None = None) -> None:
        start = time.perf_counter()
        nbytes = self.read(key, dst, between)
        counters.disk_read(nbytes, start, time.perf_counter())

    def _via_host(self, key: ExpertKey, dst: torch.Tensor, after: torch.cuda.Event | None,
                  counters: PhaseCounters, ahead: bool = False) -> Ticket:
        """Copy from the host tier, reading the expert into it from disk first when it is not there."""
        host = self.host
        assert host is not None
        table = host.table
        table.policy.on_access((key,), self.clock)
        slot = table.slot_of.get(key)
        if slot is None:
            slot = self.claim(table, key)
            if slot is None:
                raise RuntimeError("host tier has no evictable slot although nothing is pinned there")
            src = host.buffers[slot]
            ticket = self.transfers.submit(self._disk_then_copy, key, src, dst, after, counters, ahead, ahead=ahead)
        else:
            counters.host_hits += 1
            src, previous = host.buffers[slot], table.ticket[slot]
            if settled(previous):
                ticket = completed(self._copy(dst, src, after, counters, ahead))
            else:
                # the copy waits on the demand lane for the host slot's read: a prefetch's must not give way to it
                self.transfers.promote(previous)
                ticket = self.transfers.submit(self._after_then_copy, previous, src, dst, after, counters, ahead)
        table.ticket[slot] = ticket  # the host slot stays busy until the copy out of it is done
        return ticket

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None,
              counters: PhaseCounters, ahead: bool) -> torch.cuda.Event | None:
        event, seconds = self.transfers.copy(dst, src, after, ahead)
        counters.copy(src.numel() * src.element_size(), seconds)
        return event

    def _disk_then_copy(self, key: ExpertKey, src: torch.Tensor, dst: torch.Tensor, after: torch.cuda.Event | None,
                        counters: PhaseCounters, ahead: bool, between: Between | None = None
                        ) -> torch.cuda.Event | None:
        self.disk_job(key, src, counters, between)
        return self._copy(dst, src, after, counters, ahead)

    def _after_then_copy(self, previous: Ticket, src: torch.Tensor, dst: torch.Tensor, after: torch.cuda.Event | None,
                         counters: PhaseCounters, ahead: bool) -> torch.cuda.Event | None:
        previous.result()  # the host slot's own read (a copy out of it needs no wait: reads may overlap)
        return self._copy(dst, src, after, counters, ahead)

    def prefetch_bottoms(self, keys: Sequence[ExpertKey]) -> int:
        """MoEpic's prefetch of bottom segments (store/buffer.py): the bottom parts `keys`, best first, load ahead into
        the stream rows no layer is using and wait there for their layer; those that find no row wait for one. The
        list replaces the last one. Returns the loads issued now."""
        if self.buffer is None:
            raise ValueError("this store's key space loads nothing ahead into its stream rows")
        return self.buffer.want(keys)

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start loading `experts` of `layer` ahead of time (`prefetch_ranked`). Returns loads issued."""
        return self.prefetch_ranked([(layer, e) for e in experts], len(experts))

    def prefetch_ranked(self, wanted: Iterable[tuple[int, int]], limit: int) -> int:
        """Start loading the (layer, expert) pairs `wanted`, best first, into free or evictable slots until
        `limit` loads are issued, never evicting a pinned, in-flight or other prefetched expert, nor one `wanted`
        itself names (a resident expert the forecast expects its layer to use, as the trace simulator's prefetch
        protects the forecast: evicting it for a prefetch would turn a coming hit into a miss). Experts resident
        or loading are skipped, and so are those that find no slot. Returns loads issued."""
        table, keys, slots, full = self.device.table, [], [], set()
        named, keep, slot_of, protect = [], set(self.order.ahead), table.slot_of, self.order.protects_forecast
        for layer, e in wanted:  # a loop, not a comprehension: this runs after every layer a predictor observes
            key = ExpertKey(layer, e)
            named.append(key)
            if protect and key in slot_of:
                keep.add(key)
        queue = iter(named)
        while len(keys) < limit:  # rounds: the next keys up to the limit, claimed one layer at a time
            batch: dict[int, list[ExpertKey]] = {}
            count = len(keys)
            for key in queue:
                layer = key.layer
                if layer in full or key in slot_of or key in batch.get(layer, ()):
                    continue
                batch.setdefault(layer, []).append(key)
                count += 1
                if count == limit:
                    break
            if not batch:
                break
            for layer, group in batch.items():  # one ranking per layer, as claiming them one by one would evict
                claimed = table.claim_many(group, self.clock, keep)
                if len(claimed) < len(group):  # nothing more may be evicted there
                    full.add(layer)
                for key, slot in zip(group, claimed):
                    self.order.prefetched(key, slot)
                    keep.add(key)  # ahead from here on: no later claim evicts it
                    keys.append(key)
                    slots.append(slot)
        if keys:
            self.load_into(keys, slots, self.counters.current, ahead=True)
        return len(keys)

    @property
    def ahead(self) -> dict[ExpertKey, int]:
        """Experts prefetched whose layer has not routed since: key -> device slot."""
        return self.order.ahead

    def loading_ahead(self) -> list[ExpertKey]:
        """Prefetched experts still loading."""
        tickets = self.device.table.ticket
        ahead = [k for k, slot in self.order.ahead.items() if tickets[slot] is not None and not settled(tickets[slot])]
        buffer = self.buffer
        return ahead + buffer.loading() if buffer is not None and buffer.rows else ahead

    def prefetches_in_flight(self) -> int:
        return len(self.loading_ahead())

    def settle(self, layer: int, experts: Sequence[int]) -> None:
        """`layer` routed to `experts`: carry out the prefetch policy's verdict on each prefetch made for it, the
        first of its actions that applies (see the module note)."""
        table, counters, needed, order = self.device.table, self.counters.current, set(experts), self.order
        if self.buffer is not None:  # units loaded ahead into stream rows: the unneeded ones give their rows up
            self.buffer.settle(layer, needed)
        gone: set[Ticket] = set()  # given up here (a run of units read in one request shares one ticket)
        for key, slot in list(order.ahead.items()):  # a loop over a copy: judged keys leave `ahead`
            if key.layer != layer:
                continue
            ticket = table.ticket[slot]
            loading = ticket is not None and not ticket.done() or ticket in gone
            for action in order.settle_actions(key.expert in needed, loading):
                if action == "cancel" or action == "abandon":
                    assert ticket is not None
                    if ticket not in gone and not (ticket.cancel() if action == "cancel" else
                                                   self.transfers.abandon(ticket)):
                        continue  # the read started (or its lane took it): the next action applies
                    gone.add(ticket)
                    self._forget(slot)  # it never reads a byte
                    self.forget_cancelled_host_read(ticket)
                    counters.prefetch_cancelled += 1
                elif action == "promote":
                    assert ticket is not None
                    self.transfers.promote(ticket)  # it stops giving way to the layer's demand loads
                else:  # "stale" or "release": loaded, not needed
                    (order.unneeded if action == "stale" else order.release)(key)
                    counters.prefetch_wasted += 1
                break

    def _forget(self, slot: int) -> None:
        """A device slot whose load failed or was cancelled holds nothing."""
        key = self.device.table.forget(slot)
        if key is not None:
            self.order.forget((key,))

    # -- the prefetcher's view --------------------------------------------------------------------------
    def quota(self, layer: int) -> int:
        """`layer`'s even share of the device slots (a layer's cache in layer scope)."""
        return self.device.table.quota[layer]

    def cached(self, layer: int) -> set[int]:
        """`layer`'s experts holding a device slot, resident or loading (what SMoE's Fixed-N walks past)."""
        return {key.expert for key in self.device.table.by_layer[layer]}

    def forget_cancelled_host_read(self, ticket: Ticket) -> None:
        """A cancelled prefetch through the host tier never read its expert: the host slot claimed for it holds nothing
        valid, so it is freed (a demand load would otherwise find it there and wait on the cancelled read)."""
        if self.host is None:
            return
        for slot, t in enumerate(self.host.table.ticket):
            if t is ticket:
                self.host.table.forget(slot)

    def _drain(self, table: SlotTable) -> None:
        """Wait for every transfer in flight into or out of `table`'s slots."""
        for ticket in table.busy():
            event = ticket.result()
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        self.transfers.shutdown()
