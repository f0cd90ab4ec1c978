"""The run's wiring (runtime/wiring.py): composed once by the composition root, a call's recorder and replayer
plugged in for the call only, and the prefetcher out of a throwaway generation."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moepager.config import EngineConfig, PrefetchConfig, StoreConfig
from moepager.models.routing import NULL_OBSERVER, OWN_ROUTER, RoutingFanOut
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.runtime.wiring import Wiring
from moepager.types import PassInfo

INFO = PassInfo(0, "decode", (0,), (3,), (1,), ("decode",), torch.tensor([7]))


class FakeModel:
    """What the wiring drives: the model's routing observer and routing source."""

    def __init__(self):
        self.observer, self.routing = NULL_OBSERVER, OWN_ROUTER

    def observe_routing(self, observer):
        self.observer = observer

    def route_with(self, source):
        self.routing = source


class Part:
    """A pass part and routing observer that logs the passes it is told of."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def begin_pass(self, info):
        self.log.append(self.name)


class Prefetching(Part):
    def __init__(self, name, log):
        super().__init__(name, log)
        self.replay, self.resets = "unbound", 0

    def bind_replay(self, replayer):
        self.replay = replayer

    def reset_cost(self):
        self.resets += 1


def fakes():
    log: list[str] = []
    store = SimpleNamespace(begin_pass=lambda info: log.append("store"),
                            counters=SimpleNamespace(reset=lambda: log.append("reset")))
    prefetcher, paths = Prefetching("prefetcher", log), Part("paths", log)
    worker = Part("workers", log)
    return log, store, prefetcher, paths, worker


def test_passes_reach_the_placement_first_then_the_store_then_the_rest_in_order():
    log, store, prefetcher, paths, worker = fakes()
    model = FakeModel()
    wiring = Wiring(model, store, None, prefetcher, paths, [worker])  # type: ignore[arg-type]
    wiring.begin_pass(INFO)
    assert log == ["workers", "store", "prefetcher", "paths"]
    assert isinstance(model.observer, RoutingFanOut) and model.observer.observers == [prefetcher, paths]


def test_a_calls_recorder_and_replayer_are_plugged_in_for_that_call_only():
    log, store, prefetcher, paths, worker = fakes()
    model = FakeModel()
    wiring = Wiring(model, store, None, prefetcher, None, [worker])  # type: ignore[arg-type]
    assert model.observer is prefetcher  # one observer: no fan-out
    recorder, replayer = Part("recorder", log), Part("replayer", log)
    with wiring.for_call(recorder, replayer):  # type: ignore[arg-type]
        assert log == ["reset"] and prefetcher.resets == 1  # fresh counters for the call
        log.clear()
        wiring.begin_pass(INFO)
        assert log == ["workers", "store", "replayer", "recorder", "prefetcher"]
        assert model.observer.observers == [recorder, prefetcher]
        assert model.routing is replayer and prefetcher.replay is replayer
    log.clear()
    wiring.begin_pass(INFO)
    assert log == ["workers", "store", "prefetcher"]
    assert model.observer is prefetcher and model.routing is OWN_ROUTER and prefetcher.replay is None


def test_a_throwaway_generation_runs_without_the_prefetcher_and_gets_it_back():
    log, store, prefetcher, paths, _ = fakes()
    model = FakeModel()
    wiring = Wiring(model, store, None, prefetcher, paths)  # type: ignore[arg-type]
    with wiring.without_prefetcher():
        assert wiring.prefetcher is None and model.observer is paths
        wiring.begin_pass(INFO)
        assert log == ["store", "paths"]
    assert wiring.prefetcher is prefetcher and model.observer.observers == [prefetcher, paths]


def test_the_engine_built_by_the_root_tells_the_wiring_of_each_pass_and_the_model_sees_one_composition(
        hf_checkpoint):
    """A paged run with a predictor: the model's blocks report to the prefetcher the root built (not to a copy
    wired a second time), and each engine pass reaches the store's clock through the wiring."""
    _, path = hf_checkpoint("olmoe")
    probe = LLM(path, show_progress=False)
    nbytes = probe.loaded.expert_shape.nbytes
    probe.close()
    config = EngineConfig(model=str(path), store=StoreConfig(expert_memory=str(nbytes * 12), warm=False),
                          prefetch=PrefetchConfig(predictor="gate-lookahead"))
    with LLM(config=config, show_progress=False) as llm:
        blocks = llm.loaded.model.moe_blocks()
        assert llm.prefetcher is not None and all(b.observer is llm.prefetcher for b in blocks)
        seen: list[PassInfo] = []
        store_begin = llm.store.begin_pass
        llm.store.begin_pass = lambda info: (seen.append(info), store_begin(info))[1]  # type: ignore[method-assign]
        llm.generate([[5, 9, 2]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(seen) == 4  # the prompt's pass and three decode passes
        assert all(b.observer is llm.prefetcher for b in blocks)
