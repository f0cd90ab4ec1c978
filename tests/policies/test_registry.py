"""One registry, failing loudly; the engine is refused the simulator-only policies with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from moepager.config import EngineConfig, StoreConfig
from moepager.errors import MoepagerError
from moepager.policies import ENGINE_POLICIES, POLICIES, UnknownPolicyError, make_policy
from moepager.policies.base import AccessStats
from moepager.policies.lru import LRU
from moepager.runtime.builder import check_names
from moepager.types import ExpertKey


def test_registry_names_and_errors():
    assert isinstance(make_policy("lru"), LRU)
    assert ENGINE_POLICIES == ["lru", "lfu", "lrfu", "lcp", "rnd", "fmoe", "plec", "plec-lrfu"]
    with pytest.raises(UnknownPolicyError, match=r"unknown eviction policy 'lur'; choose from \['belady', "):
        make_policy("lur")
    with pytest.raises(UnknownPolicyError, match="'belady' runs only in the trace simulator"):
        make_policy("belady", engine=True)
    with pytest.raises(MoepagerError, match="runs only in the trace simulator"):  # checked where the engine is built
        check_names(EngineConfig(store=StoreConfig(expert_memory="50%", policy="smoe-fixed")))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_engine_protocol_and_array_priority_agree(name):
    """`victim` over keys picks what the vectorised priority ranks lowest (ties: lower key)."""
    rng = np.random.default_rng(0)
    policy = make_policy(name)
    stats = AccessStats.zeros(8)
    for step in range(40):
        e = int(rng.integers(8))
        policy.on_access([ExpertKey(0, e)], step)
        stats.touch(e, step)  # the simulator's update: the engine's on_access keeps what its policy reads of it
    if name in ("rnd",):
        return  # random draws; covered by its own test
    keys = [ExpertKey(0, e) for e in range(8)]
    best = int(np.argmin(policy.priority(stats, 40)))
    assert policy.victim(keys, 40) == keys[best]


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"rnd"}))
def test_victims_at_once_are_the_victims_one_after_another(name):
    """A layer's misses are claimed together: `victims(count)` must pick what `count` single evictions pick, in
    the same order (ties included: few distinct counts and steps make many)."""
    rng = np.random.default_rng(1)
    policy = make_policy(name)
    for step in range(30):
        policy.on_access([ExpertKey(0, int(e)) for e in rng.choice(12, 3, replace=False)], step // 4)
    if policy.uses_predictions:
        policy.predict(0, rng.random(12).round(1))
    keys = [ExpertKey(0, e) for e in range(12)]
    left, one_by_one = list(keys), []
    for _ in range(5):
        one_by_one.append(policy.victim(left, 8))
        left.remove(one_by_one[-1])
    assert policy.victims(keys, 5, 8) == one_by_one
