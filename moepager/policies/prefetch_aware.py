"""ExpertFlow's correction order (ExpertFlow §3.3, real-time correction) as a decorator over any eviction policy.

Prefetched experts share the cache with demand-loaded ones, so eviction needs two more facts than the inner
policy ranks by: which experts were prefetched for a layer that has not routed yet (`ahead`), and which were
prefetched and then not used when their layer ran (`stale`). The order among the candidates the store offers:
1. stale experts first (a wrong prediction is evicted before anything that was used);
2. then the inner policy's choice among experts that are not ahead;
3. experts ahead only when nothing else can go.
The store's prefetch lane reports what happens to each prefetch (`prefetched`, `used`, `unneeded`,
`forget`); the store itself only enforces that a prefetch never evicts another (it protects `ahead`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from moepager.policies.base import EvictionPolicy
from moepager.types import ExpertKey


class PrefetchAware:
    def __init__(self, inner: EvictionPolicy):
        self.inner = inner
        self.on_access = inner.on_access  # the inner policy's own (no call in between: it runs per layer and token)
        self.ahead: dict[ExpertKey, int] = {}
        """Prefetched (loaded or loading) and not yet judged by their layer's routing: key -> slot."""
        self.stale: set[ExpertKey] = set()
        """Prefetched but not used when their layer ran."""

    def victims(self, candidates: Collection[ExpertKey], count: int, step: int) -> list[ExpertKey]:
        """The order above: stale candidates first, then those not ahead, then those ahead, each group ranked by the
        inner policy (set operations, not comprehensions: this runs at every eviction)."""
        if not self.stale and not self.ahead:
            return self.inner.victims(candidates, count, step)
        out: list[ExpertKey] = []
        given = set(candidates)
        for group in (given.intersection(self.stale), given.difference(self.stale, self.ahead),
                      given.intersection(self.ahead).difference(self.stale)):
            if group:
                out += self.inner.victims(group, min(count - len(out), len(group)), step)
                if len(out) == count:
                    break
        return out

    def prefetched(self, key: ExpertKey, slot: int) -> None:
        self.ahead[key] = slot

    def used(self, keys: Iterable[ExpertKey]) -> int:
        """`keys` are used by their layer: how many of them had been prefetched for it."""
        if not self.ahead and not self.stale:
            return 0
        found = 0
        for key in keys:
            self.stale.discard(key)
            found += self.ahead.pop(key, None) is not None
        return found

    def unneeded(self, key: ExpertKey) -> None:
        """`key` was prefetched and its layer routed elsewhere: evicted first from now on."""
        del self.ahead[key]
        self.stale.add(key)

    forget = used
    """`forget(keys)`: `keys` left the cache; returns how many were still ahead (prefetches evicted before their layer
    ran). The bookkeeping of `used`: each key leaves `ahead` and `stale`."""
