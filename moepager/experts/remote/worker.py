"""An OD-MoE worker rank: the experts `Placement` may ask of it, resident or paged through a store of its own, computed
for whatever the main rank assigns it (experts/remote/executor.py) until it says stop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from moepager.errors import MoepagerError
from moepager.experts.executor import ArenaKernels, PagedExecutor
from moepager.experts.remote.placement import Links, Placement, recv_placement
from moepager.experts.remote.protocol import Place, Prefetch, Run, Stop, receive
from moepager.experts.sorting import sort_by_expert
from moepager.experts.weights import ExpertShape
from moepager.types import RoutingDecision

Holding = tuple[ArenaKernels | None, PagedExecutor | None]
"""A worker's experts: resident (kernels over its arena) or paged (an executor over its own store)."""
Hold = Callable[[Sequence[tuple[int, int]], Sequence[tuple[int, int]]], Holding]
"""Builds a worker's `Holding` from its home share and every (layer position, expert) it may be asked for
(`Placement.owned`, `Placement.holds`)."""


class ExpertWorker:
    """A worker rank: its experts held resident in one arena, or paged through an expert store of its own from the
    checkpoint on its disk (`--worker-memory`: OD-MoE's just-in-time loading, with a cache of that size); computed for
    whatever the main rank sends until it says stop, when it answers with its counters (`STATS`). A new placement
    (`Place`, after another worker was lost) makes it hold what the placement now gives it (`hold`)."""

    def __init__(self, rank: int, moe_layers: Sequence[int], num_experts: int, shape: ExpertShape,
                 placement: Placement, hold: Hold,
                 links: Links = Links(), shadow_rank: int | None = None):
        self.rank, self.moe_layers, self.num_experts, self.shape = rank, list(moe_layers), num_experts, shape
        self.group = links.of(rank)
        """Its link with the main rank (None: the default group)."""
        self.shadow = (shadow_rank, links.forecasts_of(rank)) if shadow_rank is not None else None
        """The shadow rank and the group its forecasts come on, if there is one."""
        self._lock = threading.Lock()
        """Held while the store or the forecasts change: the shadow's forecasts are taken on a thread of their own."""
        self.hold = hold
        self.calls, self._pass = 0, -1
        """Layer calls answered; the main rank's pass of the last (a new one moves its store's clock)."""
        self.forecasts: dict[tuple[int, int], set[int]] = {}
        """(pass, layer position) -> experts forecast for it, until the layer call of that pass comes."""
        self.forecast_hits, self.routed = 0, 0
        self.paged: PagedExecutor | None = None
        self._carried = torch.zeros(4, dtype=torch.float64)
        """The store counters (hits, misses, bytes read, loads ahead) of the stores earlier placements gave it."""
        self._place(placement)

    def _place(self, placement: Placement) -> None:
        layers, experts = len(self.moe_layers), self.num_experts
        holds = placement.holds(self.rank, layers, experts)
        if self.paged is not None:
            self._carried += self._store_counts()
            self.paged.store.close()
        self.kernels, self.paged = self.hold(placement.owned(self.rank, layers, experts), holds)
        self.row = {key: i for i, key in enumerate(holds)}
        self.placement = placement

    def serve(self) -> int:
        """Answer layer calls until told to stop, then send the counters; returns the calls answered. Forecasts
        (`Prefetch`) come from the main rank between its calls, and from a shadow rank on a thread of their own
        (`_take_forecasts`)."""
        d, group = self.shape.hidden, self.group
        forecasts = None
        if self.shadow is not None:
            forecasts = threading.Thread(target=self._take_forecasts, name="shadow-forecasts", daemon=True)
            forecasts.start()
        while True:
            message = receive(0, group)
            if isinstance(message, Stop):
                with self._lock:
                    dist.send(self.stats(), 0, group=group)
                if forecasts is not None:  # a shadow told to stop first has stopped them (a lost one: never mind)
                    forecasts.join(timeout=1)
                return self.calls
            if isinstance(message, Prefetch):
                self._take_forecast(message, 0, group)
                continue
            if isinstance(message, Place):
                placement = recv_placement(message, group)
                with self._lock:
                    self._place(placement)
                continue
            if not isinstance(message, Run):
                raise MoepagerError(f"worker rank {self.rank} got a {type(message).__name__} message from the main "
                                    "rank, which only the shadow takes")
            n, k = message.tokens, message.top_k
            x = torch.empty(n, d, dtype=message.x_dtype)
            ids, weights = torch.empty(n, k, dtype=torch.long), torch.empty(n, k, dtype=message.weights_dtype)
            for t in (x, ids, weights):
                dist.recv(t, 0, group=group)
            with self._lock, torch.inference_mode():
                rows = self.compute(message, x, ids, weights)
            dist.send(rows, 0, group=group)
            self.calls += 1

    def _take_forecasts(self) -> None:
        """The shadow's forecasts, until it says stop or is gone."""
        assert self.shadow is not None
        shadow, group = self.shadow
        try:
            while isinstance(message := receive(shadow, group), Prefetch):
                self._take_forecast(message, shadow, group)
        except RuntimeError:  # the shadow is gone: layer calls go on without its forecasts
            return

    def _take_forecast(self, message: Prefetch, source: int, group: dist.ProcessGroup | None) -> None:
        """The (layer position, expert) pairs after a `Prefetch` header from `source`, taken as a forecast."""
        pairs = torch.empty(message.count, 2, dtype=torch.long)
        dist.recv(pairs, source, group=group)
        with self._lock:
            self._forecast(pairs.tolist(), message.pass_id)

    def _forecast(self, pairs: list[list[int]], pass_id: int) -> None:
        """Experts forecast for a pass: remembered (to count how many it got right) and, paged, loaded ahead."""
        for p, e in pairs:
            self.forecasts.setdefault((pass_id, p), set()).add(e)
        if self.paged is not None:
            self.paged.store.prefetch_ranked([(self.moe_layers[p], e) for p, e in pairs], len(pairs))

    def compute(self, call: Run, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        """This worker's experts' rows of the layer call, in the main rank's sorted order; a paged worker's store
        counts the call in the main rank's pass (its policy's clock) and phase, both from the header."""
        position, pass_id = call.position, call.pass_id
        work = sort_by_expert(x_ND, RoutingDecision(ids_NK, weights_NK, weights_NK, ids_NK))
        ranks = self.placement.ranks_of(position, work.experts, call.phase)  # as the main rank assigned them
        which = [i for i, r in enumerate(ranks) if r == self.rank]
        named: set[int] = set()
        for key in [key for key in self.forecasts if key[1] == position and key[0] <= pass_id]:
            named |= self.forecasts.pop(key)  # every forecast for this layer up to this pass
        self.forecast_hits += sum(work.experts[i] in named for i in which)
        self.routed += len(which)
        if self.paged is not None:
            store = self.paged.store
            if pass_id != self._pass:  # a new forward pass: the clock the store's policy ranks by
                store.clock += 1
                self._pass = pass_id
            store.counters.set_phase(call.phase)
            store.settle(self.moe_layers[position], [work.experts[i] for i in which])  # judge its prefetches
            batch = self.paged.kernels.batch(work, x_ND)
            self.paged.through_store(self.moe_layers[position], work, which, batch)
        else:
            assert self.kernels is not None
            rows = [self.row.get((position, e), -1) for e in work.experts]
            batch = self.kernels.batch(work, x_ND)
            batch.some(work, rows, which, batch.y_MD)
        return batch.y_MD.index_select(0, work.rows_of(which)).contiguous()

    def stats(self) -> torch.Tensor:
        """`STATS`: calls, the store's counters (none when resident), forecast hits, routed experts (and no KV
        alignment: the shadow's)."""
        return torch.cat([torch.tensor([float(self.calls)], dtype=torch.float64), self._carried + self._store_counts(),
                          torch.tensor([self.forecast_hits, self.routed, 0.0], dtype=torch.float64)])

    def _store_counts(self) -> torch.Tensor:
        """This placement's store: hits, misses, bytes read from disk, loads ahead (zeros when resident)."""
        if self.paged is None:
            return torch.zeros(4, dtype=torch.float64)
        phases = self.paged.store.counters.phases.values()
        return torch.tensor([sum(sum(p.hits.values()) for p in phases), sum(sum(p.misses.values()) for p in phases),
                             sum(p.bytes_disk for p in phases), sum(p.loads_ahead for p in phases)],
                            dtype=torch.float64)
