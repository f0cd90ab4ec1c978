"""CUDA path of quantized experts (dequantise, then one GEMM; int4 as plain nibbles): the GPU computes what the CPU
computes, resident and paged through the pinned host tier. Runs only with `python -m pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from moepager.config import StoreConfig
from moepager.placements.paged import paged_executor
from moepager.runtime.builder import load_model
from tests.runtime.test_offload import logits_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("expert_dtype", ["int8", "int4"])
def test_quantized_experts_on_cuda_match_the_cpu(demo_checkpoint, expert_dtype):
    cpu = load_model(demo_checkpoint, show_progress=False, expert_dtype=expert_dtype)
    gpu = load_model(demo_checkpoint, device="cuda", show_progress=False, expert_dtype=expert_dtype)
    assert gpu.experts.kernels.arena.dtype == torch.uint8  # int4 as plain nibbles (int8 has one layout)
    assert expert_dtype == "int8" or gpu.expert_shape.quant.layout == "plain"
    want = logits_run(cpu)
    got = logits_run(gpu)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, atol=2e-3, rtol=2e-3)
    nbytes = gpu.expert_shape.nbytes
    paged = load_model(demo_checkpoint, device="cuda", show_progress=False, expert_dtype=expert_dtype,
                       executor_factory=paged_executor(StoreConfig(expert_memory=str(4 * nbytes), warm=False),
                                                       torch.device("cuda")))
    assert all(torch.equal(a, b) for a, b in zip(logits_run(paged), got))  # paging changes nothing

