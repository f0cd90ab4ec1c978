"""Eviction policies, one file each, and the one registry the CLI's choices come from."""

from __future__ import annotations

from collections.abc import Callable

from moepager.errors import MoepagerError
from moepager.policies.base import EvictionPolicy
from moepager.policies.lcp import LCP
from moepager.policies.lfu import LFU
from moepager.policies.lru import LRU
from moepager.policies.rnd import RND

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRU,
    "lfu": LFU,
    "lcp": LCP,
    "rnd": RND,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise MoepagerError(f"unknown eviction policy '{name}'; choose from {sorted(POLICIES)}") from None
