"""A split checkpoint's store as a predictor's prefetcher sees it: whole experts (MoEpic, §4.2: the experts the next
layer's gate predicts are fetched ahead while the current layer computes).

The store of a split checkpoint (checkpoints/split.py) keys parts (its key space, store/keyspace.py `SplitParts`):
expert e of a layer has S parts, of which the layer caches the first t (its θ = t/S) and streams the rest. A forecast
names experts, so here a forecast expert becomes its t cacheable parts, loaded ahead into the layer's cache like any
prefetch (at θ = 1 the whole expert, below it its top segment), and its bottom parts, loaded ahead into the stream rows
that no layer is using, where they wait for their layer (`ExpertStore.prefetch_bottoms`; bottoms are never cached). A
layer's routed experts settle all their parts' prefetches; a layer's quota and the loads in flight are counted in
experts. An eviction policy that ranks by forecasts (fMoE, PLEC) keys parts too: each part is given its expert's
probability (`PartForecasts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from moepager.policies.base import ForecastConsumer
from moepager.store.keyspace import SplitParts
from moepager.store.store import ExpertStore


class WholeExperts:
    """`store` (split in parts) behind the prefetcher's view of a store (store/view.py `StoreView`), in whole
    experts."""

    def __init__(self, store: ExpertStore):
        if not isinstance(store.space, SplitParts):
            raise TypeError("the view in whole experts is for a store of split experts' parts")
        self.store = store
        self.priority = store.order.priority

    @property
    def space(self) -> SplitParts:
        """The store's key space now (the online configurator may change its top parts)."""
        space = self.store.space
        assert isinstance(space, SplitParts)
        return space

    def quota(self, layer: int) -> int:
        """The experts whose cacheable parts `layer`'s cache holds."""
        return max(1, self.store.quota(layer) // self.space.tops[layer])

    def settle(self, layer: int, experts: Sequence[int]) -> None:
        space = self.space
        self.store.settle(layer, [k.expert for e in experts for k in space.keys(layer, e)])

    def cached(self, layer: int) -> set[int]:
        """`layer`'s experts whose every cacheable part holds a device slot."""
        return self.space.whole(layer, self.store.cached(layer))

    def prefetches_in_flight(self) -> int:
        """Experts with a part still loading ahead."""
        return len({(p.layer, p.expert) for p in map(self.space.part, self.store.loading_ahead())})

    def prefetch_ranked(self, wanted: Iterable[tuple[int, int]], limit: int) -> int:
        """Start loading the (layer, expert) pairs `wanted`, best first: their cacheable parts into the layer's cache,
        up to `limit` experts' worth of parts, and the bottoms of those experts into the stream rows no layer is
        using (MoEpic's prefetch buffer: the bottom when the top is cached, else with its top the whole expert).
        Returns the parts whose loads were issued."""
        store, space, pairs, bottoms = self.store, self.space, [], []
        for layer, e in wanted:
            pairs += space.top_keys(layer, e)
            bottoms += space.bottom_keys(layer, e)
        issued = store.prefetch_ranked(pairs, limit * max(space.tops.values()))
        return issued + store.prefetch_bottoms(bottoms) if bottoms else issued


class PartForecasts:
    """A forecast-ranked eviction policy over parts, fed forecasts over experts: each part gets its expert's."""

    def __init__(self, inner: ForecastConsumer, parts: int):
        self.inner, self.parts = inner, parts

    def predict(self, layer: int, probs_E: np.ndarray) -> None:
        self.inner.predict(layer, np.repeat(probs_E, self.parts))
