"""Split experts on CUDA: top parts cached in GPU slots, bottoms streamed host->device; the resident split GPU run's
tokens, and online reconfiguration changes none.

Runs only with `python -m pytest -m gpu` on a machine with CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch

from moepager.checkpoints.split import split_checkpoint
from moepager.config import StoreConfig
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["The history of", "Water boils at", "A"]


@pytest.mark.parametrize("theta", [0.5, 1.0])
@pytest.mark.parametrize("host_memory", [None, "50%"], ids=["host-resident", "host-cache-over-disk"])
def test_split_gpu_store_gives_the_resident_split_gpu_tokens(demo_checkpoint, tmp_path, theta, host_memory):
    split = split_checkpoint(demo_checkpoint, tmp_path / "s2", 2, show_progress=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    resident = LLM(split, device="cuda", show_progress=False).generate(PROMPTS, params)
    plan = tmp_path / "plan.json"
    layers = LLM(split, show_progress=False).loaded.config.num_moe_layers
    plan.write_text(json.dumps({"budgets": [1.0] * layers, "theta": [theta] * layers}))
    store = StoreConfig(expert_memory="50%", host_memory=host_memory, layer_plan=str(plan), configure="auto",
                        configure_every=4)
    llm = LLM(split, device="cuda", store=store, show_progress=False)
    paged = llm.generate(PROMPTS, params)
    assert [c.token_ids for c in paged] == [c.token_ids for c in resident]
    assert llm.store is not None and llm.store.device.buffers.is_cuda and llm.store.space.parts == 2
    assert llm.last_stats.sections["experts"].to_dict()["decode"]["bytes_host_to_device"] > 0
