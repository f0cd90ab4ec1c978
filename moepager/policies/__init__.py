"""Eviction policies, one file each, and the one registry every CLI choice comes from.

`engine` policies rank with what the engine knows at run time; the others need the trace simulator: Belady
needs the future, SMoE a next-token forecast and CPU execution of misses, static-hot a prior.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from moepager.policies.base import EvictionPolicy, Ranked
from moepager.policies.belady import Belady
from moepager.policies.fmoe import FMoE
from moepager.policies.lcp import LCP
from moepager.policies.lfu import LFU
from moepager.policies.lrfu import LRFU
from moepager.policies.lru import LRU
from moepager.policies.plec import PLEC
from moepager.policies.plec_lrfu import PLECLRFU
from moepager.policies.rnd import RND
from moepager.policies.smoe import SMoE
from moepager.policies.static_hot import StaticHot

__all__ = ["ENGINE_POLICIES", "POLICIES", "EvictionPolicy", "Ranked", "UnknownPolicyError", "make_policy",
           "policy_spec"]


class PolicySpec(NamedTuple):
    make: Callable[..., Ranked]
    engine: bool
    """Usable by the engine's store (False: trace simulator only)."""
    seeded: bool = False
    """`make` takes `seed` (random policies)."""


POLICIES: dict[str, PolicySpec] = {
    "lru": PolicySpec(LRU, True),
    "lfu": PolicySpec(LFU, True),
    "lrfu": PolicySpec(LRFU, True),
    "lcp": PolicySpec(LCP, True),
    "rnd": PolicySpec(RND, True, seeded=True),
    "fmoe": PolicySpec(FMoE, True),
    "plec": PolicySpec(PLEC, True),
    "plec-lrfu": PolicySpec(PLECLRFU, True),
    "static-hot": PolicySpec(StaticHot, False),
    "smoe-fixed": PolicySpec(lambda: SMoE(adaptive=False), False),
    "smoe-adaptive": PolicySpec(lambda: SMoE(adaptive=True), False),
    "belady": PolicySpec(Belady, False),
}
ENGINE_POLICIES = [name for name, spec in POLICIES.items() if spec.engine]


class UnknownPolicyError(ValueError):
    pass


def policy_spec(name: str, *, engine: bool = False) -> PolicySpec:
    """The registered policy `name`; `engine=True` refuses the simulator-only ones, saying why."""
    spec = POLICIES.get(name)
    choices = ENGINE_POLICIES if engine else sorted(POLICIES)
    if spec is None:
        raise UnknownPolicyError(f"unknown eviction policy '{name}'; choose from {choices}")
    if engine and not spec.engine:
        raise UnknownPolicyError(f"policy '{name}' runs only in the trace simulator (`moepager simulate`); "
                                 f"the engine can use {choices}")
    return spec


def make_policy(name: str, *, engine: bool = False, seed: int = 0) -> Ranked:
    """A fresh policy (`policy_spec`'s checks first)."""
    spec = policy_spec(name, engine=engine)
    return spec.make(seed=seed) if spec.seeded else spec.make()
