"""Checkpoints the kernel tests share."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import VOCAB


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny bf16 Qwen3-MoE whose expert width (32) takes int4 groups of 32 (the shared tiny configs' are 16)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                                         num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                                         norm_topk_prob=True, max_position_embeddings=256, eos_token_id=None,
                                         bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_bf16")
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path
