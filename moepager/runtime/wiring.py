"""Who is told of each forward pass and who sees the model's routing: composed once, by the composition root.

A run's parts that follow passes (the placement's workers and shadow feed, the store's clock, the online
configurator, the prefetcher, the batch policy's path tracker) are told of each pass in one order, and those that read
routing see each MoE block's decision through one fan-out. `Wiring` holds that composition for the engine's life;
a call that records or replays routing plugs its recorder and replayer in for its duration (`for_call`), and a
throwaway generation that only compiles runs with the prefetcher out (`without_prefetcher`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from moepager.models.layers import CausalLM
from moepager.models.routing import NULL_OBSERVER, OWN_ROUTER, RoutingFanOut, RoutingObserver
from moepager.runtime.batch_policy.expertflow import PathTracker
from moepager.runtime.configure import OnlineConfigurator
from moepager.runtime.prefetch import Prefetcher
from moepager.runtime.replay import RouteReplayer
from moepager.store.store import ExpertStore
from moepager.trace.recorder import TraceRecorder
from moepager.types import PassInfo, PassPart, Reports


class Wiring:
    """The run's pass parts and routing observers, as the composition root built them (runtime/builder.py)."""

    def __init__(self, model: CausalLM, store: ExpertStore | None, configurator: OnlineConfigurator | None,
                 prefetcher: Prefetcher | None, paths: PathTracker | None, placement_parts: Sequence[PassPart] = ()):
        self.model = model
        self.store, self.configurator, self.paths = store, configurator, paths
        self.prefetcher = prefetcher
        """Forecasts routing and loads experts ahead (None while a throwaway generation runs)."""
        self.placement_parts = tuple(placement_parts)
        """The placement's own pass parts (the workers' executor, whose layer calls carry the pass; the shadow's
        feed), told of each pass first."""
        self.reporting: tuple[Reports, ...] = tuple(p for p in (paths, *self.placement_parts) if isinstance(p, Reports))
        """The parts with a section in each call's statistics."""
        self._recorder: TraceRecorder | None = None
        self._replayer: RouteReplayer | None = None
        self._pass_parts: list[PassPart] = []
        self._connect()

    def parts(self) -> list[PassPart]:
        """What each pass is announced to, in order: the placement's parts, then the store's clock (the prefetcher's
        loads use it), the configurator, this call's replayer and recorder, the prefetcher and the path tracker."""
        parts = (self.store, self.configurator, self._replayer, self._recorder, self.prefetcher, self.paths)
        return [*self.placement_parts, *(p for p in parts if p is not None)]

    def observers(self) -> list[RoutingObserver]:
        """What sees each MoE block's routing, in order: this call's recorder, the prefetcher, the path tracker and
        the configurator."""
        return [p for p in (self._recorder, self.prefetcher, self.paths, self.configurator) if p is not None]

    def begin_pass(self, info: PassInfo) -> None:
        """The one pass clock (the engine's `on_pass`)."""
        for part in self._pass_parts:
            part.begin_pass(info)

    def _connect(self) -> None:
        """The pass parts and the model's routing observers for the parts plugged in now."""
        self._pass_parts = self.parts()
        observers = self.observers()
        self.model.observe_routing(NULL_OBSERVER if not observers else observers[0] if len(observers) == 1
                                   else RoutingFanOut(observers))

    @contextmanager
    def for_call(self, recorder: TraceRecorder | None, replayer: RouteReplayer | None) -> Iterator[None]:
        """One call's recorder and replayer plugged into the model's routing and the passes, with fresh store
        counters and report counts; unplugged after it (the prefetcher stays plugged in for the engine's life)."""
        if self.store is not None:
            self.store.counters.reset()
        if self.prefetcher is not None:
            self.prefetcher.reset_cost()
        for part in self.reporting:
            part.reset_report()
        self._recorder, self._replayer = recorder, replayer
        self._connect()
        if replayer is not None:
            self.model.route_with(replayer)
        if self.prefetcher is not None:
            self.prefetcher.bind_replay(replayer)
        try:
            yield
        finally:
            if self.prefetcher is not None:
                self.prefetcher.bind_replay(None)
            self._recorder, self._replayer = None, None
            self._connect()
            self.model.route_with(OWN_ROUTER)

    @contextmanager
    def without_prefetcher(self) -> Iterator[None]:
        """The prefetcher unplugged for a throwaway generation that only compiles (its predictor, an online
        expert-map store or a per-request path cache, learns from requests, and this one is none)."""
        prefetcher, self.prefetcher = self.prefetcher, None
        self._connect()
        try:
            yield
        finally:
            self.prefetcher = prefetcher
            self._connect()
