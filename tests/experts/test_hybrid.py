"""Hybrid execution (experts/hybrid.py): SMoE's placement rule, and outputs equal to the all-resident run on every
architecture, expert format and budget, the 'device' side computed on the CPU by the calling thread and the CPU side
by the pool's (a CPU run's data path; the CUDA run's copies and merge too, with `shared_memory` off)."""

from __future__ import annotations

import pytest
import torch

from moepager.accel import cpu_kernels
from moepager.config import EngineConfig, PlacementConfig, StoreConfig
from moepager.errors import MoepagerError
from moepager.experts.hybrid import CpuExpertsExecutor, ExpertTimes, HybridExecutor
from moepager.loading.build import resident_executor
from moepager.placements.cpu_experts import cpu_experts_executor
from moepager.placements.hybrid import hybrid_executor
from moepager.planning.cost import CostModel
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.conftest import ARCHS, expert_budget
from tests.runtime.test_offload import logits_run

HYBRID, CPU_EXPERTS = PlacementConfig(execution="hybrid"), PlacementConfig(execution="cpu-experts")

CPU = torch.device("cpu")
PREFILL_ON_DEVICE = ExpertTimes(cpu_s_1=1e-3, cpu_s_token=1e-3, device_s_1=1e-4, device_s_token=1e-5, copy_s=2.5e-3)
"""A missing expert with 3 tokens or more is copied to the device (3 ms on the CPU against 0.12 + 2.5), one with
fewer is computed on the CPU (2 against 0.11 + 2.5): prefills copy their heavy experts, decodes compute every miss
on the CPU."""


def test_placement_is_smoes_rule_on_a_fixed_cost_model():
    t = PREFILL_ON_DEVICE
    assert [t.on_device(n) for n in (1, 2, 3, 4, 64)] == [False, False, True, True, True]
    assert t.threshold() == 3
    assert "from 3 tokens up" in t.describe()
    never = ExpertTimes(cpu_s_1=1e-4, cpu_s_token=0.0, device_s_1=1e-4, device_s_token=0.0, copy_s=1e-3)
    assert never.threshold() is None and not never.on_device(10**6)
    assert "every missing expert on the CPU" in never.describe()


def test_the_cost_model_places_by_its_devices_and_link():
    gpu = CostModel.profile("h100-pcie3", 18 * 2**20).expert_times(on_cpu=False)
    assert gpu.cpu_s(1) < gpu.device_s(1) + gpu.copy_s  # a decode's miss: the CPU reads it faster than PCIe copies it
    assert gpu.threshold() is not None and gpu.threshold() > 1  # a prefill's heavy expert: copied
    fast_link = CostModel.profile("h100-pcie5", 18 * 2**20).expert_times(on_cpu=False)
    assert fast_link.on_device(1)  # PCIe 5 copies it faster than this project's 2-core CPU reads it
    same = CostModel.profile("cpu-disk", 18 * 2**20).expert_times(on_cpu=True)
    assert same.threshold() is None  # the device is the CPU: a copy never pays


def _run(path, factory, **options) -> tuple[list[torch.Tensor], object]:
    loaded = load_model(path, executor_factory=factory, show_progress=False, **options)
    return logits_run(loaded), loaded.experts


def _total(experts, counter: str) -> int:
    """A store counter summed over phases (`logits_run` calls the model without announcing passes)."""
    return sum(getattr(p, counter) for p in experts.store.counters.phases.values())


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_gives_the_resident_logits_bit_for_bit(hf_checkpoint, arch):
    _, path = hf_checkpoint(arch)
    resident = load_model(path, show_progress=False)
    ref = logits_run(resident)
    cfg, nbytes = resident.config, resident.expert_shape.nbytes
    for slots in (cfg.top_k, cfg.num_moe_layers * cfg.num_experts // 2):
        config = EngineConfig(store=StoreConfig(expert_memory=str(slots * nbytes)), placement=HYBRID)
        got, experts = _run(path, hybrid_executor(config, CPU, PREFILL_ON_DEVICE))
        assert isinstance(experts, HybridExecutor)
        assert _equal(got, ref), slots
        assert _total(experts, "on_cpu") > 0  # misses computed in the host tier (the decodes')
        assert _total(experts, "loads_on_demand") > 0  # the prefill's heavy experts copied to the device
        experts.close()


def test_hybrid_admitting_cpu_experts_in_the_background_is_lossless(hf_checkpoint):
    _, path = hf_checkpoint("deepseek_v3")
    resident = load_model(path, show_progress=False)
    ref = logits_run(resident, steps=8)
    cfg = resident.config
    slots = cfg.num_moe_layers * cfg.num_experts // 3
    config = EngineConfig(store=StoreConfig(expert_memory=str(slots * resident.expert_shape.nbytes), warm=False),
                          placement=PlacementConfig(execution="hybrid", hybrid_admit=1))
    loaded = load_model(path, executor_factory=hybrid_executor(config, CPU, PREFILL_ON_DEVICE), show_progress=False)
    assert _equal(logits_run(loaded, steps=8), ref)
    assert _total(loaded.experts, "loads_ahead") > 0 and _total(loaded.experts, "on_cpu") > 0
    loaded.experts.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_experts_gives_the_resident_logits_bit_for_bit(hf_checkpoint, arch):
    _, path = hf_checkpoint(arch)
    ref = logits_run(load_model(path, show_progress=False))
    got, experts = _run(path, cpu_experts_executor(EngineConfig(placement=CPU_EXPERTS), CPU))
    assert isinstance(experts, CpuExpertsExecutor) and experts.store is None
    assert _equal(got, ref)
    experts.close()


def test_cpu_experts_paged_from_disk_is_lossless(hf_checkpoint):
    _, path = hf_checkpoint("olmoe")
    resident = load_model(path, show_progress=False)
    ref = logits_run(resident)
    budget = expert_budget(resident.expert_shape.nbytes, resident.config.top_k + 1)
    config = EngineConfig(store=StoreConfig(host_memory=budget), placement=CPU_EXPERTS)
    got, experts = _run(path, cpu_experts_executor(config, CPU))
    assert _equal(got, ref)
    assert experts.store is not None and _total(experts, "disk_reads") > 0
    experts.close()


def test_hybrid_over_a_host_tier_smaller_than_the_model_reads_misses_from_disk(hf_checkpoint):
    _, path = hf_checkpoint("qwen2_moe")
    resident = load_model(path, show_progress=False)
    ref = logits_run(resident)
    nbytes, cfg = resident.expert_shape.nbytes, resident.config
    store = StoreConfig(expert_memory=str(cfg.top_k * nbytes), host_memory=expert_budget(nbytes, cfg.num_experts))
    config = EngineConfig(store=store, placement=HYBRID)
    got, experts = _run(path, hybrid_executor(config, CPU, PREFILL_ON_DEVICE))
    assert _equal(got, ref)
    assert _total(experts, "on_cpu") > 0 and _total(experts, "disk_reads") > 0
    experts.close()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_hybrid_on_the_fused_kernels_formats_is_bit_exact(demo_checkpoint, fmt):
    """bf16 (the fused kernel when built), int8 and int4 experts: both sides run one kernel, so rows are equal."""
    path = demo_checkpoint
    options = {"dtype": torch.bfloat16} | ({} if fmt == "bf16" else {"expert_dtype": fmt})
    resident = load_model(path, show_progress=False, **options)
    ref = logits_run(resident)
    slots = resident.config.top_k + 2
    config = EngineConfig(store=StoreConfig(expert_memory=str(slots * resident.expert_shape.nbytes)), placement=HYBRID)
    got, experts = _run(path, hybrid_executor(config, CPU, PREFILL_ON_DEVICE), **options)
    assert _equal(got, ref)
    assert _total(experts, "on_cpu") > 0
    experts.close()


@pytest.mark.parametrize("device_kernel", ["loop", "auto"])
def test_the_cuda_runs_copies_and_merge_on_the_cpu(hf_checkpoint, device_kernel):
    """`shared_memory` off: x copied to the host side, its rows copied back and merged as on CUDA. With one
    kernel on both sides (loop) the logits are the resident run's bit for bit; with the fused kernel on the CPU side
    only (rows weighted in fp32 there, as on CUDA), within a bf16 rounding."""
    _, path = hf_checkpoint("mixtral")
    resident = load_model(path, dtype=torch.bfloat16, executor_factory=resident_executor(CPU, device_kernel),
                          show_progress=False, expert_kernel=device_kernel)
    ref = logits_run(resident)
    config = EngineConfig(store=StoreConfig(expert_memory=str(4 * resident.expert_shape.nbytes)),
                          expert_kernel=device_kernel, placement=HYBRID)
    loaded = load_model(path, dtype=torch.bfloat16, executor_factory=hybrid_executor(config, CPU, PREFILL_ON_DEVICE),
                        show_progress=False, expert_kernel=device_kernel)
    experts = loaded.experts
    assert isinstance(experts, HybridExecutor)
    experts.shared_memory = False
    if device_kernel == "auto" and cpu_kernels.available():
        experts.paged.kernels.fused = None  # the device side computes with torch's kernels, as a GPU does
    got = logits_run(loaded)
    if device_kernel == "loop":
        assert _equal(got, ref)
    else:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    assert _total(experts, "on_cpu") > 0
    experts.close()


def test_execution_options_are_checked():
    with pytest.raises(MoepagerError, match="set --expert-memory"):
        EngineConfig(placement=HYBRID)
    with pytest.raises(MoepagerError, match="drop --expert-memory"):
        EngineConfig(store=StoreConfig(expert_memory="25%"), placement=CPU_EXPERTS)
    with pytest.raises(MoepagerError, match="unknown --execution"):
        EngineConfig(placement=PlacementConfig(execution="npu"))  # type: ignore[arg-type]
    with pytest.raises(MoepagerError, match="--cpu-threads must be"):
        EngineConfig(placement=PlacementConfig(execution="cpu-experts", cpu_threads=0))
    with pytest.raises(MoepagerError, match="add --execution hybrid"):
        EngineConfig(placement=PlacementConfig(hybrid_admit=1))
    with pytest.raises(MoepagerError, match="use one or the other"):
        EngineConfig(store=StoreConfig(expert_memory="25%"), compile=True, placement=HYBRID)


def test_generate_runs_each_execution_and_reports_it(demo_checkpoint, tmp_path, capsys):
    from moepager.cli.main import main

    out = {}
    for args in (["--execution", "hybrid", "--expert-memory", "25%", "--cpu-threads", "1"],
                 ["--execution", "cpu-experts"], ["--execution", "auto", "--expert-memory", "25%"], []):
        assert main(["generate", "--model", str(demo_checkpoint), "--max-tokens", "8", "--temperature", "0",
                     "--ignore-eos", "--stats-json", str(tmp_path / "s.json"), "--force", "The history of", *args]) == 0
        printed = capsys.readouterr()
        out[args[1] if args else "default"] = (printed.out.split("\n\n")[0], printed.out + printed.err)
    assert len({text for text, _ in out.values()}) == 1  # the same greedy text every way
    assert "on the CPU" in out["hybrid"][1] and "execution hybrid: every missing expert on the CPU" in out["hybrid"][1]
    assert "execution cpu-experts" in out["cpu-experts"][1]
    assert "auto: no GPU" in out["auto"][1]
    assert main(["generate", "--model", str(demo_checkpoint), "--profile", "x.json", "Hi"]) == 2
    assert main(["generate", "--model", str(demo_checkpoint), "--execution", "hybrid", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "--profile does nothing without --execution hybrid" in err and "set --expert-memory" in err


def _hybrid_llm(path, slots_per_layer: int, prefill: str) -> LLM:
    """An engine on hybrid execution with PREFILL_ON_DEVICE's costs, `slots_per_layer` cached device slots a layer
    and two stream rows, nothing warmed."""
    probe = load_model(path, show_progress=False)
    layers, nbytes = probe.config.num_moe_layers, probe.expert_shape.nbytes
    store = StoreConfig(expert_memory=str((slots_per_layer * layers + 2) * nbytes), warm=False)
    config = EngineConfig(model=str(path), store=store,
                          placement=PlacementConfig(execution="hybrid", hybrid_prefill=prefill))  # type: ignore[arg-type]
    return LLM(config=config, show_progress=False, costs=PREFILL_ON_DEVICE)


@pytest.mark.parametrize("prefill", ["ping-pong", "cache"])
def test_a_ping_pong_prefill_leaves_the_decode_cache_alone_then_fills_it_with_its_most_activated(
        hf_checkpoint, monkeypatch, prefill):
    """SMoE's prefill (§2.3, §2.4) through the engine: a 40-token prompt's heavy experts reach the device through the
    two stream rows only, so no prefill call changes what the cache holds; the first decode pass fills each layer's
    slots with the experts the prefill routed most tokens to (ties: the lower id), and decodes, whose one-token
    misses compute on the CPU, leave it so. The greedy tokens are the resident run's. `--hybrid-prefill cache`: the
    prefill's experts take cache slots."""
    _, path = hf_checkpoint("olmoe")
    prompt, params = [(7 * i + 3) % 61 + 1 for i in range(40)], SamplingParams(max_tokens=6, temperature=0.0,
                                                                            ignore_eos=True)
    want = LLM(path, show_progress=False).generate([prompt], params)[0].token_ids
    llm = _hybrid_llm(path, 2, prefill)
    executor = llm.loaded.experts
    assert isinstance(executor, HybridExecutor) and executor.prefill == prefill
    table, counters = executor.store.device.table, executor.store.counters
    counts: dict[int, dict[int, int]] = {}
    changed_in_prefill = []
    run = executor.run

    def watched(layer, x_ND, route):
        before = dict(table.slot_of)
        out = run(layer, x_ND, route)
        if counters.phase == "prefill":
            for e in route.ids_TK.reshape(-1).tolist():
                counts.setdefault(layer, {}).setdefault(e, 0)
                counts[layer][e] += 1
            changed_in_prefill.append(dict(table.slot_of) != before)
        return out

    monkeypatch.setattr(executor, "run", watched)
    assert llm.generate([prompt], params)[0].token_ids == want
    prefill_counts = counters.phases["prefill"]
    assert changed_in_prefill and prefill_counts.loads_on_demand > 0  # the heavy experts went to the device
    if prefill == "cache":
        assert any(changed_in_prefill)
        return
    assert not any(changed_in_prefill)
    for layer, c in counts.items():
        top = sorted(c, key=lambda e: (-c[e], e))[: table.quota[layer]]
        held = sorted(k.expert for k in table.slot_of if k.layer == layer)
        assert held == sorted(top), layer
    assert counters.phases["decode"].loads_ahead == len(table.slot_of)  # the initial cache's loads
    assert counters.phases["decode"].on_cpu > 0


def test_a_cpu_run_given_a_devices_profile_places_experts_as_that_device_would(hf_checkpoint):
    """The CPU stand-in (placements/base.py `expert_times`): without a profile a CPU run's two sides are the same CPU,
    so no missing expert is worth a copy and every one computes on the CPU pool; given a GPU's profile the same run
    copies a prefill's heavy experts to the 'device' as that GPU would (by the profile's figures) and computes
    them there. Either way the greedy tokens are the resident run's."""
    _, path = hf_checkpoint("olmoe")
    prompt, params = [(7 * i + 3) % 61 + 1 for i in range(40)], SamplingParams(max_tokens=4, temperature=0.0,
                                                                            ignore_eos=True)
    want = LLM(path, show_progress=False).generate([prompt], params)[0].token_ids
    probe = load_model(path, show_progress=False)
    budget = str((2 * probe.config.num_moe_layers + 2) * probe.expert_shape.nbytes)
    phases = {}
    for profile in (None, "h100-pcie3"):
        config = EngineConfig(model=str(path), store=StoreConfig(expert_memory=budget, warm=False),
                              placement=PlacementConfig(execution="hybrid", profile=profile))
        llm = LLM(config=config, show_progress=False)
        assert llm.generate([prompt], params)[0].token_ids == want
        executor = llm.loaded.experts
        assert isinstance(executor, HybridExecutor)
        phases[profile] = executor.store.counters.phases["prefill"]
    assert phases[None].loads_on_demand == 0 and phases[None].on_cpu > 0
    assert phases["h100-pcie3"].loads_on_demand > 0
