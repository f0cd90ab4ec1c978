"""The prefetcher's store view (store/view.py): its three implementations declare every member, and each ranks queued
prefetches by the rule it was given."""

from __future__ import annotations

import torch

from moepager.experts.remote.executor import RemoteExecutor
from moepager.experts.remote.placement import Placement
from moepager.experts.weights import ExpertShape
from moepager.policies.prefetch import PrefetchAware
from moepager.store.parts import WholeExperts
from moepager.store.view import StoreView
from tests.store.test_store import make_store


def test_the_store_its_whole_expert_view_and_the_workers_are_store_views():
    store, _ = make_store(8, streams=2)
    assert isinstance(store, StoreView)
    store.split(2, {0: 1, 1: 1})
    whole = WholeExperts(store)
    assert isinstance(whole, StoreView)
    remote = RemoteExecutor(ExpertShape(hidden=8, intermediate=4, dtype=torch.bfloat16), [0, 1], 4,
                            Placement.of(2, 2), None, 1.0, priority=PrefetchAware.priority)
    assert isinstance(remote, StoreView)
    assert store.priority(1.0, 2) == whole.priority(1.0, 2) == remote.priority(1.0, 2) == 0.5
    assert not isinstance(object(), StoreView)
