"""Offloading is lossless: at every budget from the minimum to all experts, with experts coming from disk or
from a host tier, prefill and decode logits equal the all-resident run's bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from moepager.config import EngineConfig, StoreConfig
from moepager.errors import BudgetError, CheckpointError, MoepagerError
from moepager.models.attention import ForwardBatch
from moepager.placements.paged import paged_executor
from moepager.policies import ENGINE_POLICIES
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.conftest import ARCHS, VOCAB, expert_budget

CPU = torch.device("cpu")


def logits_run(loaded, steps: int = 4, rows: int = 2) -> list[torch.Tensor]:
    """Right-padded prefill of two prompts (lengths 13 and 9; the first alone with rows=1, so that decode runs
    one token per step), then greedy decode steps on the model's device; every logit tensor."""
    gen, dev = torch.Generator().manual_seed(3), loaded.device
    ids = torch.randint(0, VOCAB, (2, 13), generator=gen)[:rows].to(dev)
    lens = torch.tensor([13, 9])[:rows].to(dev)
    pos = torch.arange(13, device=dev).expand(rows, 13)
    cache = loaded.model.make_cache(rows, 13 + steps, loaded.dtype, dev)
    out = []
    with torch.inference_mode():
        logits = loaded.model(ids, ForwardBatch.build(pos, valid_BT=pos < lens[:, None]), cache,
                              logits_at_B=lens - 1)
        out.append(logits)
        for step in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            logits = loaded.model(nxt, ForwardBatch.build((lens + step)[:, None]), cache,
                                  logits_at_B=torch.zeros(rows, dtype=torch.long, device=dev))
            out.append(logits)
    return out


def budgets(loaded) -> list[int]:
    cfg = loaded.config
    return list(range(cfg.top_k, cfg.num_moe_layers * cfg.num_experts + 1))


@pytest.mark.parametrize("host_tier", [False, True], ids=["disk", "host"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_budget_gives_the_resident_logits_bit_for_bit(hf_checkpoint, arch, host_tier):
    _, path = hf_checkpoint(arch, fused=host_tier)  # cover both on-disk layouts too
    resident = load_model(path, show_progress=False)
    ref = logits_run(resident)
    nbytes = resident.expert_shape.nbytes
    for slots in budgets(resident):
        for warm, scope in ((True, "layer"), (False, "global")):
            budget = str(slots * nbytes) if host_tier else expert_budget(nbytes, slots)  # host tier: buffers there
            config = StoreConfig(expert_memory=budget, warm=warm, scope=scope)
            paged = load_model(path, executor_factory=paged_executor(config, CPU, host_tier=host_tier),
                               show_progress=False)
            got = logits_run(paged)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (slots, warm, scope)
            loads = sum(p.loads_on_demand for p in paged.experts.store.counters.phases.values())
            if slots == resident.config.top_k:
                assert loads > 0  # the budget really paged
            paged.experts.store.close()


@pytest.mark.parametrize("policy", ENGINE_POLICIES)
def test_every_policy_is_lossless(hf_checkpoint, policy):
    _, path = hf_checkpoint("olmoe")
    resident = load_model(path, show_progress=False)
    ref = logits_run(resident, steps=8)
    config = StoreConfig(expert_memory=expert_budget(resident.expert_shape.nbytes, 3), policy=policy, warm=False)
    paged = load_model(path, executor_factory=paged_executor(config, CPU), show_progress=False)
    assert all(torch.equal(a, b) for a, b in zip(logits_run(paged, steps=8), ref))


def test_small_host_tier_over_disk_is_lossless(hf_checkpoint):
    _, path = hf_checkpoint("olmoe")
    ref = logits_run(load_model(path, show_progress=False))
    config = StoreConfig(expert_memory="2", host_memory="3", warm=False)  # 2-byte budget is below the minimum
    with pytest.raises(BudgetError, match="below the minimum of 2"):
        load_model(path, executor_factory=paged_executor(config, CPU, host_tier=True), show_progress=False)
    shape = load_model(path, show_progress=False).expert_shape
    config = StoreConfig(expert_memory=str(2 * shape.nbytes), host_memory=expert_budget(shape.nbytes, 5))
    paged = load_model(path, executor_factory=paged_executor(config, CPU, host_tier=True), show_progress=False)
    assert all(torch.equal(a, b) for a, b in zip(logits_run(paged), ref))
    phases = paged.experts.store.counters.phases
    assert sum(p.host_hits for p in phases.values()) > 0 and sum(p.disk_reads for p in phases.values()) > 0


def test_generate_reports_expert_statistics(demo_checkpoint, tmp_path):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    resident = LLM(demo_checkpoint, show_progress=False)
    llm = LLM(demo_checkpoint, store=StoreConfig(expert_memory="25%", direct_io="off"), show_progress=False)
    assert [c.token_ids for c in llm.generate(["The history of", "Water"], params)] == \
        [c.token_ids for c in resident.generate(["The history of", "Water"], params)]
    table = llm.last_stats.table()
    assert "decode expert hit rate" in table and "decode bytes/token" in table
    llm.last_stats.write_json(tmp_path / "s.json")
    import json

    experts = json.loads((tmp_path / "s.json").read_text())["experts"]
    decode = experts["decode"]
    cfg = llm.loaded.config
    rows = experts["config"]["device slots"] + experts["config"]["stream rows"]  # both inside the budget
    assert rows == cfg.num_moe_layers * cfg.num_experts // 4 and experts["config"]["stream rows"] == 2
    assert 0 <= decode["hit_rate"] < 1 and decode["loads_on_demand"] > 0 and decode["bytes_disk_per_token"] > 0
    assert decode["load_s"] >= decode["exposed_s"] >= 0 and len(decode["hit_rate_per_layer"]) == cfg.num_moe_layers
    assert "all resident" in resident.last_stats.table()


def test_checkpoint_modified_while_running_stops_with_a_clear_error(hf_checkpoint, tmp_path):
    _, src = hf_checkpoint("mixtral")
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    shape = load_model(path, show_progress=False).expert_shape
    llm = LLM(path, store=StoreConfig(expert_memory=expert_budget(shape.nbytes, 2), warm=False), show_progress=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with open(path / "model.safetensors", "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(CheckpointError, match="modified while running"):
        llm.generate([[1, 2, 3, 4, 5, 6, 7]], SamplingParams(max_tokens=4))


def test_host_memory_on_cpu_is_rejected_with_the_reason():
    with pytest.raises(MoepagerError, match="--host-memory applies to --device cuda"):
        EngineConfig(store=StoreConfig(host_memory="1GiB"))


def test_budget_larger_than_free_ram_is_refused_before_allocating(demo_checkpoint, monkeypatch):
    import psutil

    class Tiny:
        available = 1024

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    with pytest.raises(BudgetError, match="of RAM for its buffers but only"):
        LLM(demo_checkpoint, store=StoreConfig(expert_memory="50%", direct_io="off"), show_progress=False)
    assert os.path.exists(demo_checkpoint)


def test_the_default_eviction_is_lrfu_and_hits_at_least_as_often_as_lru():
    """On the built-in model's real routing the default policy (LRFU: recency and frequency) keeps more of what comes
    back than LRU at a 25% budget, with the same tokens."""
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    runs = {}
    for name, store in (("default", StoreConfig(expert_memory="25%", direct_io="off")),
                        ("lru", StoreConfig(expert_memory="25%", direct_io="off", policy="lru"))):
        llm = LLM(store=store, show_progress=False)
        tokens = llm.generate("The history of the city", params)[0].token_ids
        report = llm.last_stats.sections["experts"]
        runs[name] = (tokens, report.config["policy"], report.phases["decode"]["hit_rate"])
    assert runs["default"][1] == "lrfu" and runs["lru"][1] == "lru"
    assert runs["default"][0] == runs["lru"][0]
    assert runs["default"][2] >= runs["lru"][2]
