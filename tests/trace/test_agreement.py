"""The engine records traces, and the simulator replaying one gets the engine's own hits and misses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moepager.cli.main import main
from moepager.config import PlacementConfig, StoreConfig
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec
from moepager.runtime.sampling import SamplingParams
from moepager.trace.format import DECODE, PREFILL, TraceReader
from moepager.trace.simulate import SimSpec, simulate
from moepager.trace.workload import Cut, load_workload
from tests.conftest import expert_budget
from tests.trace.conftest import random_trace

PARAMS = SamplingParams(max_tokens=14, temperature=1.0, seed=3, ignore_eos=True)


def test_recorded_trace_has_every_token_and_full_gates(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("olmoe")
    llm = LLM(path, show_progress=False)
    out = llm.generate([[5, 9, 2], [7, 1]], PARAMS, record_trace=tmp_path / "t.mpt")
    with TraceReader(tmp_path / "t.mpt") as reader:
        h = reader.header
        assert (h.num_experts, h.top_k, h.moe_layers) == (8, 2, tuple(llm.loaded.config.moe_layers))
        for req, prompt, c in zip(reader, [[5, 9, 2], [7, 1]], out, strict=True):
            n_decode = len(c.token_ids) - 1  # the last sampled token is never fed back
            assert req.phase_T.tolist() == [PREFILL] * len(prompt) + [DECODE] * n_decode
            assert req.token_ids_T.tolist() == (prompt + c.token_ids)[: req.num_tokens]
            np.testing.assert_allclose(req.gates_TLE.sum(-1), 1.0, rtol=1e-5)  # softmax router: distributions
            top = np.argsort(-req.gates_TLE, axis=-1, kind="stable")[..., :2]
            assert (np.sort(top, -1) == np.sort(req.ids_TLK, -1)).all()


def assert_same_hits_and_misses(phases, sim, moe_layers) -> None:
    """The store's hits and misses per phase and layer equal the simulator's."""
    for phase, code in (("prefill", PREFILL), ("decode", DECODE)):
        rows = sim.step_phase == code
        for column, layer in enumerate(moe_layers):
            engine = (phases[phase].hits[layer], phases[phase].misses[layer])
            replay = (int(sim.hits_SL[rows, column].sum()),
                      int((sim.requested_SL[rows, column] - sim.hits_SL[rows, column]).sum()))
            assert engine == replay, (phase, layer)


@pytest.mark.parametrize("policy", ["lru", "lfu", "lrfu", "lcp", "fmoe"])
def test_simulator_agrees_with_the_engine(hf_checkpoint, tmp_path, policy):
    _, path = hf_checkpoint("olmoe")
    probe = LLM(path, show_progress=False)
    layers, nbytes = len(probe.loaded.config.moe_layers), probe.loaded.expert_shape.nbytes
    per_layer = 4  # >= the prefill's distinct experts per layer (2 tokens x top-2)
    store = StoreConfig(expert_memory=expert_budget(nbytes, per_layer * layers), policy=policy, warm=False)
    llm = LLM(path, store=store, show_progress=False)
    llm.generate([[3, 11]], PARAMS, record_trace=tmp_path / "run.mpt")
    phases = llm.loaded.experts.store.counters.phases
    sim = simulate(load_workload(str(tmp_path / "run.mpt"), order="recorded"), SimSpec(policy, per_layer))
    assert_same_hits_and_misses(phases, sim, llm.loaded.config.moe_layers)
    assert sum(phases["decode"].misses.values()) > 0  # the cache was small enough to matter


@pytest.mark.parametrize("policy, warm, scope", [("lru", False, "layer"), ("lfu", False, "layer"),
                                                ("lcp", False, "layer"), ("lrfu", False, "layer"),
                                                ("lru", True, "layer"),
                                                ("lcp", True, "layer"), ("lru", True, "global")])
def test_simulator_agrees_with_a_replayed_run(hf_checkpoint, tmp_path, policy, warm, scope):
    """A prompt-only trace (recorded like DeepSeek-V2-Lite's) replayed with --route-prompt: the engine's hits
    and misses per layer and phase equal `moepager simulate`'s on the same trace, cut and capacity."""
    _, path = hf_checkpoint("olmoe")
    trace = random_trace(tmp_path / "t.mpt", lengths=(12, 9, 15), prefill=15, seed=2)
    per_layer, nbytes = 4, LLM(path, show_progress=False).loaded.expert_shape.nbytes
    llm = LLM(path, store=StoreConfig(expert_memory=expert_budget(nbytes, per_layer * 3), policy=policy, warm=warm,
                                      scope=scope), show_progress=False)
    llm.replay(ReplaySpec(trace, prompt_tokens=2))
    phases = llm.loaded.experts.store.counters.phases
    capacity = per_layer if scope == "layer" else per_layer * 3
    sim = simulate(load_workload(str(trace), "recorded", cut=Cut(prompt_tokens=2)),
                   SimSpec(policy, capacity, scope, warm=warm))
    assert_same_hits_and_misses(phases, sim, llm.loaded.config.moe_layers)
    assert main(["simulate", str(trace), "--order", "recorded", "--route-prompt", "2", "--policy", policy,
                 "--capacity", str(capacity), "--scope", scope, "--json", str(tmp_path / "sim.json")]
                + ["--warm"] * warm) == 0
    row = json.loads((tmp_path / "sim.json").read_text())["rows"][0]
    assert row["decode_hit_rate"] == pytest.approx(llm.last_stats.sections["experts"].phases["decode"]["hit_rate"])
    assert sum(phases["decode"].misses.values()) > 0


@pytest.mark.parametrize("policy, scope, per_layer", [("lru", "layer", 3), ("lfu", "layer", 2), ("lru", "global", 2)])
def test_layers_needing_more_experts_than_their_cache_stream_the_rest_as_the_simulator_does(
        hf_checkpoint, tmp_path, policy, scope, per_layer):
    """8-token prompts route to more distinct experts per layer than the layer's cache holds: the store keeps
    the hits and the first misses that fit, streams the rest through its stream rows, and takes no slot from
    another layer, so every later step's hits and misses still equal the simulator's."""
    _, path = hf_checkpoint("olmoe")
    trace = random_trace(tmp_path / "t.mpt", lengths=(12, 9, 15), prefill=15, seed=5, skew=0.5)
    nbytes = LLM(path, show_progress=False).loaded.expert_shape.nbytes
    llm = LLM(path, store=StoreConfig(expert_memory=expert_budget(nbytes, per_layer * 3), policy=policy, warm=False,
                                      scope=scope), show_progress=False)
    llm.replay(ReplaySpec(trace, prompt_tokens=8))
    phases = llm.loaded.experts.store.counters.phases
    capacity = per_layer if scope == "layer" else per_layer * 3
    work = load_workload(str(trace), "recorded", cut=Cut(prompt_tokens=8))
    sim = simulate(work, SimSpec(policy, capacity, scope))
    assert (sim.requested_SL > capacity).any()  # some steps really overflow
    assert_same_hits_and_misses(phases, sim, llm.loaded.config.moe_layers)
    loads = sum(p.loads_on_demand for p in phases.values())
    assert loads == sim.loads  # every miss was loaded once: cached or streamed through
    table = llm.loaded.experts.store.device.table
    assert all(len(keys) <= table.quota[layer] for layer, keys in table.by_layer.items()) or scope == "global"


@pytest.mark.parametrize("prefill", ["ping-pong", "cache"])
@pytest.mark.parametrize("warm, admit", [(False, 0), (True, 0), (True, 1), (False, 2)])
def test_simulator_agrees_with_a_hybrid_run(hf_checkpoint, tmp_path, warm, admit, prefill):
    """`--execution hybrid` against `simulate --execution hybrid` at the same threshold (3 tokens), either prefill:
    8-token prompts send their heavy experts to the device (ping-pong: streamed through, then each layer's most
    activated loaded ahead at the first decode step; cache: cached or streamed through) and compute the light ones on
    the CPU, as do every decode step's misses; the hits, misses, loads and CPU-computed experts are the
    simulator's."""
    from moepager.config import EngineConfig
    from tests.experts.test_hybrid import PREFILL_ON_DEVICE

    _, path = hf_checkpoint("olmoe")
    trace = random_trace(tmp_path / "t.mpt", lengths=(12, 9, 15), prefill=15, seed=5, skew=0.5)
    per_layer, nbytes = 3, LLM(path, show_progress=False).loaded.expert_shape.nbytes
    store = StoreConfig(expert_memory=str(nbytes * (per_layer * 3 + 2)), policy="lru", warm=warm)
    llm = LLM(config=EngineConfig(model=str(path), store=store,
                                  placement=PlacementConfig(execution="hybrid", hybrid_admit=admit,
                                                            hybrid_prefill=prefill)),
              show_progress=False, costs=PREFILL_ON_DEVICE)
    llm.replay(ReplaySpec(trace, prompt_tokens=8))
    phases = llm.loaded.experts.store.counters.phases
    spec = SimSpec("lru", per_layer, warm=warm, execution="hybrid", device_tokens=PREFILL_ON_DEVICE.threshold(),
                   admit=admit, hybrid_prefill=prefill)
    sim = simulate(load_workload(str(trace), "recorded", cut=Cut(prompt_tokens=8)), spec)
    assert_same_hits_and_misses(phases, sim, llm.loaded.config.moe_layers)
    assert sum(p.loads_on_demand for p in phases.values()) == int(sim.demand_loads_SL.sum()) > 0
    assert sum(p.on_cpu for p in phases.values()) == int(sim.cpu_SL.sum()) > 0
    assert sum(p.loads_ahead for p in phases.values()) == int(sim.prefetch_loads_SL.sum())
    assert (sim.prefetch_loads_SL.sum() > 0) == (admit > 0 or prefill == "ping-pong")


@pytest.mark.parametrize("policy, seqs, budget", [("fifo", 2, 6), ("fifo", 3, 64), ("expertflow", 2, 64),
                                                  ("expertflow", 2, 6)])
def test_simulator_in_the_engines_step_order_agrees_with_a_batched_replay(hf_checkpoint, tmp_path, policy, seqs,
                                                                           budget):
    """`simulate --order engine`: 5 requests, 3 at a time, prompts chunked under a small token budget beside decodes
    (or not), FIFO or ExpertFlow's groups: the simulator's passes are the engine's, so its hits and misses per phase
    and layer, and its loads, are the engine's."""
    from moepager.config import EngineConfig, SchedulerConfig
    from moepager.runtime.step_order import engine_steps

    _, path = hf_checkpoint("olmoe")
    trace = random_trace(tmp_path / "t.mpt", lengths=(12, 9, 15, 11, 13), prefill=15, seed=6, skew=0.5)
    per_layer, nbytes = 3, LLM(path, show_progress=False).loaded.expert_shape.nbytes
    scheduler = SchedulerConfig(max_num_seqs=seqs, max_batched_tokens=budget, batch_policy=policy)
    store = StoreConfig(expert_memory=expert_budget(nbytes, per_layer * 3), policy="lru", warm=False)
    llm = LLM(config=EngineConfig(model=str(path), store=store, scheduler=scheduler), show_progress=False)
    llm.replay(ReplaySpec(trace, prompt_tokens=5), concurrency=3)
    phases = llm.loaded.experts.store.counters.phases
    work = engine_steps(load_workload(str(trace), "recorded", cut=Cut(prompt_tokens=5)), scheduler, 3)
    sim = simulate(work, SimSpec("lru", per_layer))
    assert_same_hits_and_misses(phases, sim, llm.loaded.config.moe_layers)
    assert sum(p.loads_on_demand for p in phases.values()) == sim.loads
    assert (np.diff(work.step_ptr) > 1).any()  # batched passes
    assert main(["simulate", str(trace), "--order", "engine", "--route-prompt", "5", "--batch", "3", "--max-num-seqs",
                 str(seqs), "--max-batched-tokens", str(budget), "--batch-policy", policy, "--policy", "lru",
                 "--capacity", str(per_layer), "--json", str(tmp_path / "sim.json")]) == 0
    row = json.loads((tmp_path / "sim.json").read_text())["rows"][0]
    assert row["decode_hit_rate"] == pytest.approx(llm.last_stats.sections["experts"].phases["decode"]["hit_rate"])


def test_a_layer_plan_splits_the_cache_unevenly_as_the_simulators_per_layer_capacities(hf_checkpoint, tmp_path):
    """`--layer-plan`: each layer's cache sized from a plan's budgets (MoEpic's per-layer V_i), warm-started with its
    own experts 0..quota-1; the engine's hits and misses equal the simulator's with those per-layer capacities, and
    the logits the resident run's."""
    from tests.runtime.test_offload import logits_run

    _, path = hf_checkpoint("olmoe")
    trace = random_trace(tmp_path / "t.mpt", lengths=(12, 9, 15), prefill=15, seed=2)
    nbytes = LLM(path, show_progress=False).loaded.expert_shape.nbytes
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"budgets": [1.0, 5.5, 2.5]}))
    for warm in (False, True):
        store = StoreConfig(expert_memory=expert_budget(nbytes, 9), policy="lru", warm=warm, layer_plan=str(plan))
        llm = LLM(path, store=store, show_progress=False)
        quotas = list(llm.loaded.experts.store.device.table.quota.values())
        assert quotas == [2, 5, 2]  # each at least its top-2, the rest by the budgets
        llm.replay(ReplaySpec(trace, prompt_tokens=2))
        sim = simulate(load_workload(str(trace), "recorded", cut=Cut(prompt_tokens=2)),
                       SimSpec("lru", max(quotas), per_layer=tuple(quotas), warm=warm))
        assert_same_hits_and_misses(llm.loaded.experts.store.counters.phases, sim, llm.loaded.config.moe_layers)
        assert "per-layer cache 2 5 2" in llm.last_stats.table()
    from moepager.placements.paged import paged_executor
    from moepager.runtime.builder import load_model

    ref = logits_run(load_model(path, show_progress=False))
    paged = load_model(path, executor_factory=paged_executor(store, torch.device("cpu")), show_progress=False)
    assert all(torch.equal(a, b) for a, b in zip(logits_run(paged), ref))


def test_layer_plans_are_checked(hf_checkpoint, tmp_path):
    from moepager.errors import ConfigError, MoepagerError

    _, path = hf_checkpoint("olmoe")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"budgets": [1.0, 2.0]}))
    with pytest.raises(ConfigError, match="budgets for 2 layers; this model has 3"):
        LLM(path, store=StoreConfig(expert_memory="50%", layer_plan=str(bad)), show_progress=False)
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="not a `moepager plan --json` file"):
        LLM(path, store=StoreConfig(expert_memory="50%", layer_plan=str(bad)), show_progress=False)
    with pytest.raises(MoepagerError, match="set --expert-memory"):
        StoreConfig(layer_plan=str(bad))
