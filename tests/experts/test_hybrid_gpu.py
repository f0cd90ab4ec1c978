"""Hybrid execution on CUDA: the device side on the GPU, the CPU side in pinned host memory; close to the GPU-only
run (the CPU's kernel rounds otherwise), the same greedy tokens on the built-in model.

Runs only with `python -m pytest -m gpu` on a machine with CUDA.
"""

from __future__ import annotations

import pytest
import torch

from moepager.config import EngineConfig, PlacementConfig, StoreConfig
from moepager.experts.hybrid import HybridExecutor
from moepager.placements.cpu_experts import cpu_experts_executor
from moepager.placements.hybrid import hybrid_executor
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.experts.test_hybrid import PREFILL_ON_DEVICE
from tests.runtime.test_offload import logits_run

HYBRID, CPU_EXPERTS = PlacementConfig(execution="hybrid"), PlacementConfig(execution="cpu-experts")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_hybrid_and_cpu_experts_on_cuda_are_close_to_the_gpu_run(hf_checkpoint, arch):
    _, path = hf_checkpoint(arch)
    ref = logits_run(load_model(path, dtype=torch.bfloat16, device="cuda", show_progress=False))
    nbytes = load_model(path, show_progress=False).expert_shape.nbytes
    hybrid = EngineConfig(device="cuda", store=StoreConfig(expert_memory=str(6 * nbytes)), placement=HYBRID)
    for factory in (hybrid_executor(hybrid, CUDA, PREFILL_ON_DEVICE),
                    cpu_experts_executor(EngineConfig(device="cuda", placement=CPU_EXPERTS), CUDA)):
        loaded = load_model(path, dtype=torch.bfloat16, device="cuda", executor_factory=factory, show_progress=False)
        for a, b in zip(logits_run(loaded), ref):
            assert a.device.type == "cuda"
            torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)
        if isinstance(loaded.experts, HybridExecutor):
            phases = loaded.experts.store.counters.phases.values()
            assert sum(p.on_cpu for p in phases) > 0 and sum(p.loads_on_demand for p in phases) > 0
        loaded.experts.close()


def test_hybrid_generate_on_cuda_gives_the_gpu_runs_tokens(demo_checkpoint):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    gpu = LLM(demo_checkpoint, device="cuda", show_progress=False).generate(["The history of"], params)
    for execution, store in (("hybrid", StoreConfig(expert_memory="25%")), ("cpu-experts", StoreConfig()),
                             ("auto", StoreConfig(expert_memory="25%"))):
        llm = LLM(config=EngineConfig(model=str(demo_checkpoint), device="cuda", store=store,
                                      placement=PlacementConfig(execution=execution)),
                  show_progress=False)
        out = llm.generate(["The history of"], params)
        assert out[0].token_ids[:6] == gpu[0].token_ids[:6], execution  # fp32: the CPU's roundings differ late
        assert llm.loaded.execution
