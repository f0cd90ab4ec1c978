"""Prefetch policies: what becomes of prefetched experts, beside the eviction policy they share the cache with.

A prefetch policy decides three things the store (mechanism) then carries out:
- the order a tier evicts in once prefetched experts are among the candidates (`victims`, a decorator over the
  tier's eviction policy);
- what a layer's real routing does to the prefetches made for it (`settle_actions`: cancel a queued one, abandon
  one waiting to start, promote a needed one so it stops giving way, mark an unneeded one stale, or release it);
- what a prefetch may evict (`protects_forecast`) and how queued prefetches are ranked (`priority`).

Registered in PREFETCH_POLICIES (`--prefetch-policy`): `expertflow` (the default: ExpertFlow §3.3's real-time
correction, below) and `plain` (no correction: a prefetch runs to the end whatever its layer routes to, and an unused
one is an ordinary resident the eviction policy ranks like any other).

ExpertFlow's correction order (ExpertFlow §3.3, real-time correction) over any eviction policy:

Prefetched experts share the cache with demand-loaded ones, so eviction needs two more facts than the inner
policy ranks by: which experts were prefetched for a layer that has not routed yet (`ahead`), and which were
prefetched and then not used when their layer ran (`stale`). The order among the candidates the store offers:
1. stale experts first (a wrong prediction is evicted before anything that was used);
2. then the inner policy's choice among experts that are not ahead;
3. experts ahead only when nothing else can go.
The store's prefetch lane reports what happens to each prefetch (`prefetched`, `used`, `unneeded`, `release`,
`forget`); the store itself only enforces that a prefetch never evicts another (it protects `ahead`).
Priority of a queued prefetch (fMoE): its forecast probability mass over the MoE layers until its layer runs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Literal

from moepager.policies.base import Ranked
from moepager.types import ExpertKey

Action = Literal["cancel", "abandon", "promote", "stale", "release"]
"""What the store does to a prefetch when its layer routes: `cancel` it if it is still queued (then a needed expert
loads on demand at once), `abandon` it if it waits on the lane to start, `promote` it (it stops giving way to
demand loads), mark it `stale` (evicted first), or `release` it (an ordinary resident from now on). The store tries a
verdict's actions in order until one applies (cancel and abandon may find the read already started)."""


class PrefetchAware:
    """The expertflow prefetch policy (the default); `corrects=False` gives `plain`."""

    def __init__(self, inner: Ranked, corrects: bool = True):
        self.inner = inner
        self.corrects = corrects
        """ExpertFlow's real-time correction; False: prefetches run to the end and are never stale."""
        self.protects_forecast = corrects
        """A prefetch never evicts a resident expert the forecast that asked for it names (that would turn a coming
        hit into a miss; the trace simulator's prefetch protects the forecast the same way)."""
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

    def release(self, key: ExpertKey) -> None:
        """`key` was prefetched and its layer routed elsewhere: an ordinary resident from now on."""
        del self.ahead[key]

    def settle_actions(self, needed: bool, loading: bool) -> tuple[Action, ...]:
        """What its layer's routing does to a prefetch (tried in order; see `Action`)."""
        if not self.corrects:
            return () if needed else ("release",)
        if needed:
            return ("cancel", "promote") if loading else ()
        return ("cancel", "abandon", "stale") if loading else ("stale",)

    @staticmethod
    def priority(mass: float, layers_until: int) -> float:
        """A queued prefetch's rank (fMoE): forecast probability mass over the MoE layers until its layer runs."""
        return mass / layers_until

    forget = used
    """`forget(keys)`: `keys` left the cache; returns how many were still ahead (prefetches evicted before their layer
    ran). The bookkeeping of `used`: each key leaves `ahead` and `stale`."""


PREFETCH_POLICIES = {"expertflow": True, "plain": False}
"""`--prefetch-policy` name -> whether it corrects prefetches when their layer routes (see the module note)."""


class UnknownPrefetchPolicyError(ValueError):
    pass


def make_prefetch_policy(name: str, inner: Ranked) -> PrefetchAware:
    """The prefetch policy `name` over a tier's eviction policy."""
    if name not in PREFETCH_POLICIES:
        raise UnknownPrefetchPolicyError(f"unknown prefetch policy '{name}'; choose from {list(PREFETCH_POLICIES)}")
    return PrefetchAware(inner, corrects=PREFETCH_POLICIES[name])
