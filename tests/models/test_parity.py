"""Our model code against transformers on tiny random checkpoints, in both expert layouts."""

from __future__ import annotations

import pytest
import torch

from moepager.models.attention import ForwardBatch
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.conftest import ARCHS, VOCAB

ATOL = 1e-4


@pytest.mark.parametrize("fused", [False, True], ids=["hub-layout", "fused-layout"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_transformers(hf_checkpoint, arch, fused):
    hf, path = hf_checkpoint(arch, fused)
    ours = load_model(path, show_progress=False)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    cache = ours.model.make_cache(2, 64, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        ref = hf(ids, use_cache=True)
        got = ours.model(ids, ForwardBatch.build(torch.arange(11).expand(2, 11)), cache)
        torch.testing.assert_close(got, ref.logits, atol=ATOL, rtol=0)
        past, nxt = ref.past_key_values, ref.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(16):
            ref = hf(nxt, past_key_values=past, use_cache=True)
            got = ours.model(nxt, ForwardBatch.build(torch.full((2, 1), 11 + step)), cache)
            torch.testing.assert_close(got, ref.logits, atol=ATOL, rtol=0)
            past, nxt = ref.past_key_values, ref.logits[:, -1].argmax(-1, keepdim=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers_for_32_tokens(hf_checkpoint, arch):
    hf, path = hf_checkpoint(arch)
    prompt = [5, 17, 42, 8, 63, 2]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    llm = LLM(path, show_progress=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))
    assert out[0].token_ids == ref[0, len(prompt):].tolist()


def test_dtype_conversion_keeps_router_bias_fp32(hf_checkpoint):
    _, path = hf_checkpoint("deepseek_v3")
    lm = load_model(path, dtype=torch.bfloat16, show_progress=False)
    params = dict(lm.model.named_parameters())
    buffers = dict(lm.model.named_buffers())
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert buffers["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    cache = lm.model.make_cache(1, 8, torch.bfloat16, torch.device("cpu"))
    logits = lm.model(torch.tensor([[1, 2, 3]]), ForwardBatch.build(torch.arange(3)[None]), cache)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
