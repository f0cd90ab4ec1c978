"""A split checkpoint's store as a predictor's prefetcher sees it: whole experts (MoEpic, §4.2: the experts the next
layer's gate predicts are fetched ahead while the current layer computes).

The store of a split checkpoint (checkpoints/split.py) keys parts: expert e of a layer is parts e·S .. e·S + S - 1,
of which the layer caches the first t (its θ = t/S, `ExpertStore.cached_parts`) and streams the rest. A forecast names
experts, so here a forecast expert becomes its t cacheable parts, loaded ahead into the layer's cache like any
prefetch (at θ = 1 the whole expert, below it its top segment), and its bottom parts, loaded ahead into the stream
rows that no layer is using, where they wait for their layer (`ExpertStore.prefetch_bottoms`; bottoms are never
cached). A layer's routed experts settle all their parts' prefetches; a layer's quota and the loads in flight are
counted in experts. An eviction policy that ranks by forecasts (fMoE, PLEC) keys parts too: each part is given its
expert's probability (`PartForecasts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from moepager.policies.base import ForecastConsumer
from moepager.store.store import ExpertStore
from moepager.types import ExpertKey


class WholeExperts:
    """`store` (split in parts) behind the prefetcher's view of a store (store/view.py `StoreView`), in whole
    experts."""

    def __init__(self, store: ExpertStore):
        assert store.parts > 1
        self.store = store
        self.priority = store.order.priority

    def quota(self, layer: int) -> int:
        """The experts whose cacheable parts `layer`'s cache holds."""
        return max(1, self.store.quota(layer) // self.store.cached_parts[layer])

    def settle(self, layer: int, experts: Sequence[int]) -> None:
        parts = self.store.parts
        self.store.settle(layer, [e * parts + j for e in experts for j in range(parts)])

    def cached(self, layer: int) -> set[int]:
        """`layer`'s experts whose every cacheable part holds a device slot."""
        parts, top = self.store.parts, self.store.cached_parts[layer]
        held = self.store.cached(layer)
        return {p // parts for p in held if p % parts == 0 and all(p + j in held for j in range(1, top))}

    def prefetches_in_flight(self) -> int:
        """Experts with a part still loading ahead."""
        parts = self.store.parts
        return len({(key.layer, key.expert // parts) for key in self.store.loading_ahead()})

    def prefetch_ranked(self, wanted: Iterable[tuple[int, int]], limit: int) -> int:
        """Start loading the (layer, expert) pairs `wanted`, best first: their cacheable parts into the layer's cache,
        up to `limit` experts' worth of parts, and the bottoms of those experts into the stream rows no layer is
        using (MoEpic's prefetch buffer: the bottom when the top is cached, else with its top the whole expert).
        Returns the parts whose loads were issued."""
        store, pairs, bottoms = self.store, [], []
        top, parts = store.cached_parts, store.parts
        for layer, e in wanted:
            pairs += [(layer, e * parts + j) for j in range(top[layer])]
            bottoms += [ExpertKey(layer, e * parts + j) for j in range(top[layer], parts)]
        issued = store.prefetch_ranked(pairs, limit * max(top.values()))
        return issued + store.prefetch_bottoms(bottoms) if bottoms else issued


class PartForecasts:
    """A forecast-ranked eviction policy over parts, fed forecasts over experts: each part gets its expert's."""

    def __init__(self, inner: ForecastConsumer, parts: int):
        self.inner, self.parts = inner, parts

    def predict(self, layer: int, probs_E: np.ndarray) -> None:
        self.inner.predict(layer, np.repeat(probs_E, self.parts))
