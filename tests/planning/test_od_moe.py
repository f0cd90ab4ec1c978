"""OD-MoE's pipeline on paper (planning/od_moe.py): the formulas by hand, and what more workers and a better
shadow do."""

from __future__ import annotations

import numpy as np
import pytest

from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Placement
from moepager.planning.cost import DEVICES, LINKS, Device, Link
from moepager.planning.od_moe import (
    Cluster,
    expert_compute_s,
    prefill_times,
    resident_step_times,
    step_times,
    worker_shares,
)

GPU = Device("test", 1e12, 1e15, 0.0)
MIB = 2**20


def cluster(workers: int, recall: float, group: int = 2) -> Cluster:
    return Cluster(workers, group, GPU, Link("host", 10e9, 0.0), Link("lan", 1e9, 0.0), 1e-3, recall)


def test_one_layer_by_hand():
    requested, tokens = np.array([[2]]), np.array([1])
    c = cluster(8, recall=1.0)  # 4 groups; each worker loads one 100 MiB expert in 10.49 ms
    load, compute = 100 * MIB / 10e9, 100 * MIB / 1e12
    hop = 8192 / 1e9
    maxload = 4 * (1e-3 + 2 * hop) + 3 * compute
    expected = 1e-3 + 2 * hop + compute + max(0.0, load - maxload)
    assert step_times(c, requested, tokens, 100 * MIB, 8192, 2)[0] == pytest.approx(expected)
    missed = step_times(cluster(8, recall=0.0), requested, tokens, 100 * MIB, 8192, 2)[0]
    assert missed == pytest.approx(1e-3 + 2 * hop + compute + load)  # every load after the routing is known


def test_more_workers_and_a_better_shadow_never_slow_a_step():
    rng = np.random.default_rng(0)
    requested, tokens = rng.integers(1, 3, (50, 32)), np.ones(50, int)
    times = {n: step_times(cluster(n, 0.97), requested, tokens, 336 * MIB, 8192, 2).sum() for n in (2, 4, 8, 16)}
    assert times[2] >= times[4] >= times[8] >= times[16]
    assert step_times(cluster(8, 0.99), requested, tokens, 336 * MIB, 8192, 2).sum() <= times[8]
    resident = resident_step_times(GPU, 1e-3, requested, tokens, 336 * MIB, 2).sum()
    assert resident < times[16]  # nothing beats having every expert in memory


def test_the_papers_profiles_exist_and_bad_clusters_are_refused():
    assert DEVICES["rtx3090"].mem_Bps < DEVICES["rtx4090"].mem_Bps and LINKS["1gbe"].bytes_per_s < 125e6
    assert expert_compute_s(GPU, 2 * MIB, np.array([1.0]))[0] == pytest.approx(2 * MIB / 1e12)
    with pytest.raises(MoepagerError):
        Cluster(2, 3, GPU, LINKS["pcie4"], LINKS["1gbe"], 1e-3, 0.9)
    with pytest.raises(MoepagerError):
        Cluster(2, 2, GPU, LINKS["pcie4"], LINKS["1gbe"], 1e-3, 1.5)


def test_worker_caches_load_only_what_they_miss():
    """--worker-cache: a group's caches hold their workers' shares of its layers, and a step loads only the misses
    (compute still covers every routed expert)."""
    from moepager.planning.od_moe import group_cache

    c = cluster(8, 0.0)  # 4 groups of 2: 32 layers give 8 to each group
    assert group_cache(c, 32, 8, 16) == 4  # 16 experts a worker over 8 layers, 2 workers a layer
    assert group_cache(c, 32, 8, 64) == 8  # never more than the layer's experts
    assert group_cache(cluster(2, 0.0), 32, 8, 8) == 0
    requested, tokens = np.full((10, 4), 2), np.ones(10, int)
    cacheless = step_times(c, requested, tokens, 100 * MIB, 8192, 2)
    cached = step_times(c, requested, tokens, 100 * MIB, 8192, 2, loaded_SL=np.zeros_like(requested))
    assert np.all(cached < cacheless)
    compute = 100 * MIB / 1e12
    assert cached[0] == pytest.approx(4 * (1e-3 + 2 * 8192 / 1e9 + compute))  # no load left to stall on


def test_simulate_models_worker_caches(tmp_path, capsys):
    from moepager.cli.main import main
    from tests.trace.conftest import random_trace

    trace = random_trace(tmp_path / "t.mpt", lengths=(40, 30), experts=8)
    args = ["simulate", str(trace), "--profile", "rtx4090-pcie4", "--expert-bytes", str(100 * MIB), "--workers", "4"]
    assert main(args) == 0
    cacheless = capsys.readouterr().out
    assert main([*args, "--worker-cache", "64"]) == 0
    cached = capsys.readouterr().out
    assert "cacheless" in cacheless and "experts cached on each worker" in cached and "a group caches" in cached
    rate = {name: float(out.strip().splitlines()[-1].split()[2]) for name, out in (("none", cacheless),
                                                                                   ("cached", cached))}
    assert rate["cached"] > rate["none"]


def test_simulate_models_the_prompts_on_the_workers(tmp_path, capsys):
    """`simulate --workers --worker-prefill spread,group`: the trace's prompt chunks on paper, each mode against the
    group's; a spread prompt's busiest worker takes fewer experts, so it is faster. Refused without prompts, without
    --workers, or with an unknown mode."""
    from moepager.cli.main import main
    from tests.trace.conftest import random_trace

    trace = random_trace(tmp_path / "t.mpt", lengths=(40, 30), experts=8, prefill=12)
    args = ["simulate", str(trace), "--order", "recorded", "--profile", "rtx4090-pcie4", "--expert-bytes",
            str(100 * MIB), "--workers", "8", "--worker-group", "2"]
    assert main([*args, "--worker-prefill", "spread,group"]) == 0
    out = capsys.readouterr().out
    assert "prompts: 2 chunks, 12.0 tokens on average" in out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith("      8  ")
            and line.split()[1] in ("spread", "group")}
    assert float(rows["group"][3]) == 1.0 and float(rows["spread"][3]) < 1.0
    assert float(rows["spread"][2]) < float(rows["group"][2])
    bad = [([*args, "--worker-prefill", "everywhere"], "choose spread or group"),
           ([a for a in args if a not in ("--workers", "8")] + ["--worker-prefill", "spread"], "add --workers N")]
    bad.append(([a if a != "recorded" else "decode" for a in args] + ["--worker-prefill", "spread"],
                "use --order recorded or engine"))
    for argv, message in bad:
        assert main(argv) != 0
        assert message in capsys.readouterr().err


def test_the_model_assigns_every_call_as_the_engine_does():
    """`worker_shares` is the engine's assignment (`Placement.ranks_of`) call for call: with one-to-one the busiest
    worker takes ceil(n / G) of a call's n experts, which is what `step_times` assumes by default; with fixed, at
    least that, and more where experts share a home."""
    rng = np.random.default_rng(1)
    routed = rng.random((40, 6, 16)) < 0.15
    n = routed.sum(2)
    for workers, group in ((4, 2), (6, 3), (2, 2)):
        one = worker_shares(routed, Placement.of(workers, group))
        fixed = worker_shares(routed, Placement.of(workers, group, "fixed"))
        assert np.array_equal(one, np.ceil(n / group).astype(int))
        assert np.all(fixed >= one) and np.any(fixed > one)
        for s, layer in ((0, 0), (7, 3), (39, 5)):  # the engine's own assignment of the same call
            ranks = Placement.of(workers, group, "fixed").ranks_of(layer, np.flatnonzero(routed[s, layer]).tolist())
            assert fixed[s, layer] == max(map(ranks.count, ranks), default=0)
    c, tokens = cluster(4, 0.5), np.ones(40, int)
    fixed = worker_shares(routed, Placement.of(4, 2, "fixed"))
    assert step_times(c, n, tokens, 100 * MIB, 8192, 2).sum() == pytest.approx(
        step_times(c, n, tokens, 100 * MIB, 8192, 2, share_SL=np.ceil(n / 2)).sum())
    assert step_times(c, n, tokens, 100 * MIB, 8192, 2, share_SL=fixed).sum() > \
        step_times(c, n, tokens, 100 * MIB, 8192, 2).sum()


def test_a_spread_prefill_splits_a_prompts_layer_over_every_worker():
    """OD-MoE §2.7 on paper: a prompt routing to all 8 experts of every layer; with 8 workers in groups of 2, the
    layer's group of 2 computes 4 experts each, spread over all 8 one each: the busiest worker's load and compute, and
    so the layer, shrink 4 times less the fixed part. By hand for one layer."""
    routed = np.ones((1, 2, 8), bool)
    n, tokens = routed.sum(2), np.array([128])
    spread, grouped = Placement.of(8, 2, prefill="spread"), Placement.of(8, 2)
    assert worker_shares(routed, spread, "prefill").tolist() == [[1, 1]]
    assert worker_shares(routed, grouped, "prefill").tolist() == [[4, 4]]
    assert worker_shares(routed, spread).tolist() == [[4, 4]]  # decode calls keep to the group
    c = cluster(8, 0.0)
    per_expert = 100 * MIB / 10e9 + expert_compute_s(GPU, 100 * MIB, np.array([128 * 2 / 8]))[0]
    fixed = 1e-3 + 2 * 128 * 8192 / 1e9
    for placement, busiest in ((spread, 1), (grouped, 4)):
        share = worker_shares(routed, placement, "prefill")
        got = prefill_times(c, n, tokens, 100 * MIB, 8192, 2, share)[0]
        assert got == pytest.approx(2 * (fixed + busiest * per_expert))
