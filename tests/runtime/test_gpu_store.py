"""CUDA expert store: pinned host tier, copy stream, slots on the GPU; same tokens as the resident GPU run.

Runs only with `python -m pytest -m gpu` on a machine with CUDA.
"""

from __future__ import annotations

import pytest
import torch

from moepager.config import StoreConfig
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["The history of", "Water boils at", "A"]


@pytest.mark.parametrize("host_memory", [None, "50%"], ids=["host-resident", "host-cache-over-disk"])
@pytest.mark.parametrize("expert_memory", ["25%", "50%", "all"])
def test_gpu_store_is_bit_exact_with_the_resident_gpu_run(demo_checkpoint, expert_memory, host_memory):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    resident = LLM(demo_checkpoint, device="cuda", show_progress=False).generate(PROMPTS, params)
    llm = LLM(demo_checkpoint, device="cuda", store=StoreConfig(expert_memory=expert_memory,
                                                                host_memory=host_memory), show_progress=False)
    paged = llm.generate(PROMPTS, params)
    assert [c.token_ids for c in paged] == [c.token_ids for c in resident]
    store = llm.loaded.experts.store
    assert store.device.buffers.is_cuda and store.host is not None and store.host.buffers.is_pinned()
    assert store.transfers.copy_stream is not None and store.transfers.copy_stream != torch.cuda.current_stream()
    decode = llm.last_stats.sections["experts"].to_dict()["decode"]
    if expert_memory != "all":
        assert decode["bytes_host_to_device"] > 0
    if host_memory is not None:
        assert sum(p["disk_reads"] for k, p in llm.last_stats.sections["experts"].to_dict().items()
                   if k != "config") > 0


def test_copies_overlap_compute_on_the_copy_stream(demo_checkpoint):
    """A copy into a slot waits for the slot's last use, recorded as an event on the compute stream."""
    llm = LLM(demo_checkpoint, device="cuda", store=StoreConfig(expert_memory="25%"), show_progress=False)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    store = llm.loaded.experts.store
    assert any(e is not None for e in store.device.table.free_event)
    torch.cuda.synchronize()
    assert all(p == 0 for p in store.device.table.pins)


@pytest.mark.parametrize("predictor", ["gate-lookahead", "expert-map"])
@pytest.mark.parametrize("host_memory", [None, "50%"], ids=["host-resident", "host-cache-over-disk"])
def test_gpu_prefetch_is_bit_exact_and_loads_ahead(demo_checkpoint, predictor, host_memory):
    from moepager.config import PrefetchConfig

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    resident = LLM(demo_checkpoint, device="cuda", show_progress=False).generate(PROMPTS, params)
    llm = LLM(demo_checkpoint, device="cuda", store=StoreConfig(expert_memory="25%", host_memory=host_memory),
              prefetch=PrefetchConfig(predictor, learn=predictor == "expert-map"), show_progress=False)
    assert [c.token_ids for c in llm.generate(PROMPTS, params)] == [c.token_ids for c in resident]
    assert llm.last_stats.sections["experts"].to_dict()["decode"]["loads_ahead"] > 0
