"""The vectorised simulator against the one-access-at-a-time reference, hand-made sequences, and Belady."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moepager.planning.cost import CostModel
from moepager.trace.format import DECODE, TraceError, TraceHeader, TraceRequest, TraceWriter
from moepager.trace.simulate import SimSpec, simulate
from moepager.trace.workload import Cut, load_workload
from tests.trace.conftest import random_trace
from tests.trace.reference import reference_hits

DETERMINISTIC = ["lru", "lfu", "lcp", "fmoe", "belady", "static-hot"]


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("order,batch", [("decode", 1), ("recorded", 1), ("recorded", 2)])
@pytest.mark.parametrize("policy", DETERMINISTIC)
def test_fast_simulator_matches_the_reference(tmp_path, policy, scope, order, batch):
    path = random_trace(tmp_path / "t.mpt", missing=0.05)
    work = load_workload(str(path), order, batch)
    prior = work.counts_LE()[::-1].copy()  # some prior, deliberately not the trace's own ranking
    for capacity in ([2, 3, 5, 8] if scope == "layer" else [2, 6, 12, 24]):
        result = simulate(work, SimSpec(policy, capacity, scope), prior)
        requested, hits = reference_hits(work, policy, capacity, scope, prior)
        np.testing.assert_array_equal(result.requested_SL, requested)
        np.testing.assert_array_equal(result.hits_SL, hits, err_msg=f"{policy} capacity {capacity}")


def _one_layer_trace(path, sequence, experts=4, top_k=1):
    ids = np.array(sequence, np.int16).reshape(len(sequence), 1, top_k)
    with TraceWriter(path, TraceHeader("hand", (0,), experts, top_k)) as w:
        w.add(TraceRequest(ids, np.full(len(sequence), DECODE, np.uint8)))
    return load_workload(str(path))


def test_hand_made_sequences(tmp_path):
    work = _one_layer_trace(tmp_path / "h.mpt", [0, 1, 0, 2, 1, 0, 3, 0])
    hits = {p: simulate(work, SimSpec(p, 2)).hits_SL[:, 0].tolist() for p in ("lru", "lfu", "belady")}
    # LRU (2 slots): 0 1 |0 hit| 2 evicts 1 | 1 evicts 0 | 0 evicts 2 | 3 evicts 1 | 0 hit
    assert hits["lru"] == [0, 0, 1, 0, 0, 0, 0, 1]
    # LFU keeps 0 (count 2 by step 2): 2 evicts 1, 1 evicts 2, 0 hit, 3 evicts 1, 0 hit
    assert hits["lfu"] == [0, 0, 1, 0, 0, 1, 0, 1]
    # Belady: at 2, next uses 0@5, 1@4 -> evict 0? no: evict the furthest, 0 (5); then 1 hit; 0 evicts 2 ...
    assert hits["belady"] == [0, 0, 1, 0, 1, 0, 0, 1]
    assert sum(hits["belady"]) >= max(sum(hits["lru"]), sum(hits["lfu"]))


def test_an_oracle_horizon_sees_past_the_next_step(tmp_path):
    work = _one_layer_trace(tmp_path / "h.mpt", [0, 1, 2, 3, 0])
    hits = {h: simulate(work, SimSpec("plec", 2, forecast="oracle", horizon=h)).hits_SL[:, 0].tolist()
            for h in (1, 2)}
    # At step 2 (expert 2 misses, 0 and 1 cached) the next step names neither: one step ahead PLEC falls back to LRU
    # and evicts 0, two steps ahead it sees 0 at step 4 and keeps it (evicting 1, then 2 for 3).
    assert hits[1] == [0, 0, 0, 0, 0]
    assert hits[2] == [0, 0, 0, 0, 1]
    assert simulate(work, SimSpec("belady", 2)).hits_SL.sum() >= 1
    with pytest.raises(TraceError, match="needs forecast 'oracle'"):
        simulate(work, SimSpec("plec", 2, forecast="repeat", horizon=2))
    with pytest.raises(TraceError, match="1 step or more"):
        simulate(work, SimSpec("plec", 2, forecast="oracle", horizon=0))


def test_smoe_prefetches_at_most_n_per_layer_and_step(tmp_path):
    work = load_workload(str(random_trace(tmp_path / "t.mpt", experts=16, top_k=3)))
    fixed = simulate(work, SimSpec("smoe-fixed", 6, forecast="repeat"))
    adaptive = simulate(work, SimSpec("smoe-adaptive", 6, forecast="repeat"))
    assert fixed.demand_loads_SL.sum() == 0 and adaptive.demand_loads_SL.sum() == 0  # misses run on the CPU
    assert (fixed.prefetch_loads_SL[0] == 2).all()  # empty cache: the top 2 of the 3 predicted
    assert (fixed.prefetch_loads_SL <= 2).all() and (adaptive.prefetch_loads_SL <= 2).all()
    assert adaptive.loads < fixed.loads  # fixed-N walks on to the 3rd prediction when the top 2 are cached
    oracle = simulate(work, SimSpec("smoe-fixed", 6, forecast="oracle"))
    assert oracle.hit_rate() > fixed.hit_rate()
    with pytest.raises(TraceError, match="prefetches from a forecast"):
        simulate(work, SimSpec("smoe-fixed", 6))


def test_errors_say_the_minimum(tmp_path):
    work = load_workload(str(random_trace(tmp_path / "t.mpt")))
    with pytest.raises(TraceError, match="use at least 2"):
        simulate(work, SimSpec("lru", 1))
    with pytest.raises(TraceError, match="needs a prior"):
        simulate(work, SimSpec("static-hot", 4))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), capacity=st.integers(2, 7), scope=st.sampled_from(["layer", "global"]),
       skew=st.floats(0.0, 2.0))
def test_belady_is_never_beaten(tmp_path, seed, capacity, scope, skew):
    """One token per step: MIN is optimal when every step's experts fit the cache. (A prefill step needing more than
    a layer holds admits its misses in the order asked, whatever their next use, so there another policy can end
    with a better cache: seed 2208, capacity 3, skew 1.94, 4-token prefills gave LFU 69 hits against 68.)"""
    path = random_trace(tmp_path / f"b{seed}.mpt", experts=8, lengths=(12, 9), prefill=1, seed=seed, skew=skew)
    work = load_workload(str(path), "recorded")
    cap = capacity if scope == "layer" else capacity * 3
    prior = work.counts_LE()
    best = simulate(work, SimSpec("belady", cap, scope)).hits_SL.sum()
    # Static-hot is left out: it starts with a preloaded cache, and MIN is optimal from the same start.
    for policy in ("lru", "lfu", "lcp", "fmoe", "rnd"):
        assert simulate(work, SimSpec(policy, cap, scope, seed=seed), prior).hits_SL.sum() <= best, policy


def test_cost_model_orders_overlap_and_links():
    n = np.array([[4, 4]])
    h = np.array([[2, 4]])
    z = np.zeros_like(n)
    tokens = np.array([1])
    model = CostModel.profile("h100-pcie5", 17 << 20)
    none = CostModel.profile("h100-pcie5", 17 << 20, overlap="none")
    slow = CostModel.profile("h100-pcie3", 17 << 20)
    t_layer = model.step_times(n, h, z, tokens, 2, False)[0]
    assert none.step_times(n, h, z, tokens, 2, False)[0] > t_layer
    assert slow.step_times(n, h, z, tokens, 2, False)[0] > t_layer
    all_hits = model.step_times(n, n, z, tokens, 2, False)[0]
    assert all_hits == pytest.approx(8 * model.compute_s(0.5))
    assert t_layer > all_hits


def test_replayed_forecasts_drive_plec_eviction_and_prefetch(tmp_path):
    from moepager.trace.simulate import Forecasts

    # one layer, top-1 of 4 experts, 2 slots: the sequence cycles 0 1 2 0 1 2 ..., which LRU always misses
    sequence = [0, 1, 2] * 10
    work = _one_layer_trace(tmp_path / "c.mpt", sequence)
    exact_next = np.array(sequence[1:] + [-1], np.int16).reshape(-1, 1, 1)  # the true next use
    lru = simulate(work, SimSpec("lru", 2))
    assert lru.hit_rate() == 0.0
    evict = simulate(work, SimSpec("plec", 2, forecast="predictor"), replayed=Forecasts(next_NLR=exact_next))
    assert evict.hit_rate() > 0.4 and evict.prefetch_loads_SL.sum() == 0  # keeps what comes next
    ahead = np.array(sequence, np.int16).reshape(-1, 1, 1)  # a perfect forecast of each token, made before it
    both = simulate(work, SimSpec("plec", 2, forecast="predictor", prefetch=1),
                    replayed=Forecasts(next_NLR=exact_next, ahead_NLR=ahead))
    assert both.hit_rate() == 1.0 and both.demand_loads_SL.sum() == 0  # every expert is there when it routes
    wrong = simulate(work, SimSpec("lru", 2, forecast="predictor", prefetch=1),
                     replayed=Forecasts(next_NLR=exact_next, ahead_NLR=(ahead + 1) % 4))
    assert wrong.hit_rate() == 0.0 and wrong.loads > lru.loads  # wrong forecasts only cost loads


def test_replayed_forecasts_are_checked(tmp_path):
    from moepager.trace.simulate import Forecasts

    work = _one_layer_trace(tmp_path / "c.mpt", [0, 1, 2, 3])
    with pytest.raises(TraceError, match="needs a fitted predictor's forecasts"):
        simulate(work, SimSpec("plec", 2, forecast="predictor"))
    with pytest.raises(TraceError, match="cover 2 tokens, the workload has 4"):
        simulate(work, SimSpec("plec", 2, forecast="predictor"), replayed=Forecasts(np.zeros((2, 1, 1), np.int16)))
    with pytest.raises(TraceError, match="prefetch replays a fitted predictor's forecasts"):
        simulate(work, SimSpec("lru", 2, prefetch=1))
    with pytest.raises(TraceError, match="prefetch needs the predictor's forecasts ahead"):
        simulate(work, SimSpec("lru", 2, forecast="predictor", prefetch=1),
                 replayed=Forecasts(np.zeros((4, 1, 1), np.int16)))


def test_cost_model_places_misses_on_the_cpu_for_hybrid_execution():
    """cpu_SL of the misses on the CPU: all of them is SMoE's policy (misses_on_cpu), none is gpu execution, and a
    layer takes the longer of its device part and its CPU part."""
    n, h, z, tokens = np.array([[4, 4]]), np.array([[1, 4]]), np.zeros((1, 2)), np.array([1])
    model = CostModel.profile("h100-pcie3", 17 << 20)
    gpu = model.step_times(n, h, z, tokens, 2, False)[0]
    assert model.step_times(n, h, z, tokens, 2, False, cpu_SL=np.zeros((1, 2)))[0] == gpu
    every = model.step_times(n, h, z, tokens, 2, False, cpu_SL=n - h)[0]
    assert every == pytest.approx(model.step_times(n, h, z, tokens, 2, True)[0])
    c, c_cpu = model.compute_s(0.5), model.cpu_compute_s(np.array(0.5))
    assert every == pytest.approx(max(c, 3 * c_cpu) + 4 * c)
    assert every < gpu  # PCIe 3 copies an expert slower than the CPU computes it


def test_hybrid_replay_computes_light_misses_on_the_cpu_and_admits_nothing_of_them(tmp_path):
    trace = random_trace(tmp_path / "t.mpt", lengths=(12, 9), prefill=12, seed=4)
    work = load_workload(str(trace), "recorded")
    gpu = simulate(work, SimSpec("lru", 4))
    never = simulate(work, SimSpec("lru", 4, execution="hybrid", device_tokens=None, hybrid_prefill="cache"))
    assert never.loads == 0 and never.hits_SL.sum() == 0  # nothing ever enters a cold cache
    assert int(never.cpu_SL.sum()) == never.misses == int(never.requested_SL.sum())
    steps = load_workload(str(trace), "recorded", cut=Cut(prompt_tokens=4))  # a prefill, then decode steps
    assert set(steps.step_phase.tolist()) == {0, 1}
    seeded = simulate(steps, SimSpec("lru", 4, execution="hybrid", device_tokens=None))
    assert seeded.demand_loads_SL.sum() == 0 and seeded.prefetch_loads_SL.sum() > 0  # only the initial cache loads
    assert seeded.hits_SL.sum() > 0
    some = simulate(work, SimSpec("lru", 4, execution="hybrid", device_tokens=2, hybrid_prefill="cache"))
    assert 0 < some.loads < gpu.loads and some.cpu_SL.sum() > 0
    assert (some.demand_loads_SL + some.cpu_SL == some.requested_SL - some.hits_SL).all()
    with pytest.raises(TraceError, match="hybrid execution places"):
        simulate(work, SimSpec("smoe-fixed", 4, forecast="repeat", execution="hybrid"))


def test_a_workloads_distinct_experts_per_step_are_the_simulators_requests(tmp_path):
    trace = random_trace(tmp_path / "t.mpt", lengths=(12, 9), prefill=12, seed=4)
    for order in ("decode", "recorded"):
        work = load_workload(str(trace), order)
        assert (work.requested_SL() == simulate(work, SimSpec("lru", 4)).requested_SL).all()


def test_a_chunked_prefill_runs_as_steps_of_at_most_the_chunk(tmp_path):
    """`load_workload(chunk=C)`: a recorded prefill of P tokens becomes ceil(P / C) prefill steps of at most C tokens
    in order (the engine's --max-batched-tokens), alone and in a batch, and the decode steps are unchanged."""
    trace = random_trace(tmp_path / "t.mpt", lengths=(20, 15), prefill=10)
    whole = load_workload(str(trace), "recorded")
    for batch in (1, 2):
        work = load_workload(str(trace), "recorded", batch=batch, chunk=4)
        prefill = [work.step_tokens[work.step_ptr[s]:work.step_ptr[s + 1]].tolist()
                   for s in range(work.num_steps) if work.step_phase[s] == 0]
        assert prefill == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [20, 21, 22, 23], [24, 25, 26, 27], [28, 29]]
        assert int((work.step_phase == 1).sum()) == int((load_workload(str(trace), "recorded", batch=batch)
                                                         .step_phase == 1).sum())
    assert (whole.step_phase == 0).sum() == 2
    with pytest.raises(TraceError, match="at least 1 token"):
        load_workload(str(trace), "recorded", chunk=0)


def test_hybrid_replays_budgets_below_the_top_k(tmp_path):
    """SMoE's budgets (3% of DeepSeek-V3's experts, fewer slots than its top-8): hybrid execution replays a cache
    of fewer experts than a token routes to (a miss computes on the CPU or streams through uncached), the cache never
    holds more than its slots; gpu execution still refuses it."""
    trace = random_trace(tmp_path / "t.mpt", top_k=3, lengths=(30, 25), prefill=12)
    work = load_workload(str(trace), "recorded")
    for prefill in ("ping-pong", "cache"):
        got = simulate(work, SimSpec("lru", 1, execution="hybrid", device_tokens=2, hybrid_prefill=prefill))
        assert got.hits_SL.sum() > 0 and (got.hits_SL <= 1).all()
        assert (got.demand_loads_SL + got.cpu_SL == got.requested_SL - got.hits_SL).all()
    with pytest.raises(TraceError, match=r"use at least 3 \(or --execution hybrid\)"):
        simulate(work, SimSpec("lru", 1))
    with pytest.raises(TraceError, match="use at least 1$"):
        simulate(work, SimSpec("lru", 0, execution="hybrid"))
