"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA with per-head RMSNorm on q and k, routed experts only.

Router: softmax (fp32) -> top-k -> optional renormalisation (`norm_topk_prob`) -> cast to activation dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moepager.errors import CheckpointError
from moepager.experts.source import ExpertSource
from moepager.models.base import PER_EXPERT_MLP, Architecture, common_fields
from moepager.models.config import ModelConfig, get, rope_from_raw
from moepager.models.layers import (Attention, CausalLM, DecoderLayer, DecoderStack, DenseMLP, MoEBlock,
                                    RotaryEmbedding, SoftmaxTopKRouter)
from moepager.models.qwen2_moe import sparse_layers


def parse_config(raw: Mapping[str, Any]) -> ModelConfig:
    if raw.get("use_sliding_window"):
        raise CheckpointError("Qwen3-MoE with use_sliding_window=true is not supported")
    fields = common_fields(raw, default_eps=1e-6, default_max_pos=32768)
    head_dim = get(raw, "head_dim", fields["hidden_size"] // fields["num_heads"], kind=int)
    return ModelConfig(
        **fields,
        head_dim=head_dim,
        rope=rope_from_raw(raw, head_dim),
        moe_layers=sparse_layers(raw, fields["num_layers"]),
        num_experts=get(raw, ("num_experts", "num_local_experts"), kind=int),
        top_k=get(raw, "num_experts_per_tok", kind=int),
        expert_intermediate_size=get(raw, "moe_intermediate_size", kind=int),
        dense_intermediate_size=get(raw, "intermediate_size", kind=int),
    )


def build(cfg: ModelConfig, source: ExpertSource) -> CausalLM:
    bias = bool(cfg.raw.get("attention_bias", False))
    normalize = bool(cfg.raw.get("norm_topk_prob", False))

    def mlp(i: int) -> MoEBlock | DenseMLP:
        if i not in cfg.moe_layers:
            return DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)
        router = SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, normalize=normalize,
                                   fp32_weights=False)
        return MoEBlock(router, source, i, cfg.num_experts)

    layers = [DecoderLayer(cfg, Attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head"), mlp(i))
              for i in range(cfg.num_layers)]
    return CausalLM(cfg, DecoderStack(cfg, layers, RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)))


ARCHITECTURE = Architecture("Qwen3MoeForCausalLM", parse_config, build, PER_EXPERT_MLP)
