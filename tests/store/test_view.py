"""The prefetcher's store view (store/view.py): its three implementations declare every member, and each ranks queued
prefetches by the rule it was given."""

from __future__ import annotations

import torch

from moepager.experts.remote.executor import RemoteExecutor
from moepager.experts.remote.placement import Placement
from moepager.experts.weights import ExpertShape
from moepager.policies.prefetch import PrefetchAware
from moepager.store.keyspace import SplitParts
from moepager.store.parts import WholeExperts
from moepager.store.view import StoreView
from tests.store.test_store import make_store


def test_the_store_its_whole_expert_view_and_the_workers_are_store_views():
    store, _ = make_store(8, streams=2)
    assert isinstance(store, StoreView)
    store.use(SplitParts(2, {0: 1, 1: 1}))
    whole = WholeExperts(store)
    assert isinstance(whole, StoreView)
    remote = RemoteExecutor(ExpertShape(hidden=8, intermediate=4, dtype=torch.bfloat16), [0, 1], 4,
                            Placement.of(2, 2), None, 1.0, priority=PrefetchAware.priority)
    assert isinstance(remote, StoreView)
    assert store.priority(1.0, 2) == whole.priority(1.0, 2) == remote.priority(1.0, 2) == 0.5
    assert not isinstance(object(), StoreView)


def test_the_store_and_its_whole_expert_view_say_which_experts_a_layer_holds():
    """What SMoE's Fixed-N walks past (runtime/prefetch.py): the experts with a device slot, resident or loading;
    in whole experts, those whose every cacheable part has one."""
    from types import SimpleNamespace

    from tests.store.test_store import consume

    store, _ = make_store(4, streams=2)
    consume(store, 0, [3, 1])
    consume(store, 1, [2])
    assert store.cached(0) == {1, 3} and store.cached(1) == {2}
    whole = WholeExperts.__new__(WholeExperts)
    for top, want in ((2, {0}), (1, {0, 1})):  # parts 2e, 2e + 1 of expert e; held: all of 0, half of 1 and 2
        whole.store = SimpleNamespace(space=SplitParts(2, {0: top}), cached=lambda layer: {0, 1, 2, 5})
        assert whole.cached(0) == want
