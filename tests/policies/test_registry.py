"""One registry, failing loudly; the engine is refused the simulator-only policies with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from moepager.config import StoreConfig
from moepager.errors import MoepagerError
from moepager.policies import ENGINE_POLICIES, POLICIES, UnknownPolicyError, make_policy
from moepager.policies.base import AccessStats
from moepager.policies.lru import LRU
from moepager.types import ExpertKey


def test_registry_names_and_errors():
    assert isinstance(make_policy("lru"), LRU)
    assert ENGINE_POLICIES == ["lru", "lfu", "lcp", "rnd", "fmoe", "plec"]
    with pytest.raises(UnknownPolicyError, match=r"unknown eviction policy 'lur'; choose from \['belady', "):
        make_policy("lur")
    with pytest.raises(UnknownPolicyError, match="'belady' runs only in the trace simulator"):
        make_policy("belady", engine=True)
    with pytest.raises(MoepagerError, match="runs only in the trace simulator"):
        StoreConfig(expert_memory="50%", policy="smoe-fixed")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_engine_protocol_and_array_priority_agree(name):
    """`victim` over keys picks what the vectorised priority ranks lowest (ties: lower key)."""
    rng = np.random.default_rng(0)
    policy = make_policy(name)
    stats = AccessStats.zeros(8)
    for step in range(40):
        e = int(rng.integers(8))
        policy.on_access([ExpertKey(0, e)], step)
        stats.count[e] += 1
        stats.last[e] = step
    if name in ("rnd",):
        return  # random draws; covered by its own test
    keys = [ExpertKey(0, e) for e in range(8)]
    best = int(np.argmin(policy.priority(stats, 40)))
    assert policy.victim(keys, 40) == keys[best]
