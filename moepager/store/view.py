"""What the prefetcher (runtime/prefetch.py) drives: a store as a forecast's target. Three things implement it: the
expert store itself (store/store.py `ExpertStore`), a split checkpoint's store seen in whole experts
(store/parts.py `WholeExperts`), and OD-MoE's main rank, whose forecasts become its workers' loads ahead
(experts/remote/executor.py `RemoteExecutor`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

Priority = Callable[[float, int], float]
"""(probability mass, MoE layers until needed) -> a queued prefetch's rank."""


@runtime_checkable
class StoreView(Protocol):
    priority: Priority
    """How queued prefetches are ranked (the store's prefetch policy's rule)."""

    def quota(self, layer: int) -> int:
        """At most this many of `layer`'s experts are queued ahead."""
        ...

    def settle(self, layer: int, experts: Sequence[int]) -> None:
        """`layer` routed to `experts`: its prefetches are judged (used, or wasted)."""
        ...

    def prefetches_in_flight(self) -> int:
        """Prefetches still loading (the prefetcher keeps at most its max_inflight going)."""
        ...

    def prefetch_ranked(self, wanted: Iterable[tuple[int, int]], limit: int) -> int:
        """Start loading up to `limit` of the (layer, expert) pairs `wanted`, best first; returns the loads issued."""
        ...
