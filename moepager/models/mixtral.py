"""Mixtral (MixtralForCausalLM): GQA attention with optional sliding window, 8 SwiGLU experts, top-2.

Router: softmax over all experts in fp32, top-k, renormalise the k weights to sum to 1 (weights stay fp32).
Hub checkpoints name the MoE block `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down);
transformers' fused layout names it `mlp` with `gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moepager.experts.executor import ExpertExecutor
from moepager.models.attention import Attention, RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.base import Architecture, ExpertNaming, common_fields
from moepager.models.config import ModelConfig, get, rope_from_raw
from moepager.models.layers import CausalLM, DecoderLayer, DecoderStack
from moepager.models.moe import MoEBlock, SoftmaxTopKRouter


def parse_config(raw: Mapping[str, Any]) -> ModelConfig:
    fields = common_fields(raw, default_eps=1e-5, default_max_pos=131072)
    head_dim = get(raw, "head_dim", fields["hidden_size"] // fields["num_heads"], kind=int)
    layers = fields["num_layers"]
    return ModelConfig(
        **fields,
        head_dim=head_dim,
        rope=rope_from_raw(raw, head_dim, default_theta=1e6),
        moe_layers=tuple(range(layers)),
        num_experts=get(raw, "num_local_experts", kind=int),
        top_k=get(raw, "num_experts_per_tok", kind=int),
        expert_intermediate_size=get(raw, "intermediate_size", kind=int),
        dense_intermediate_size=get(raw, "intermediate_size", kind=int),
        sliding_window=get(raw, "sliding_window", None),
    )


def router(cfg: ModelConfig, backend: Backend) -> SoftmaxTopKRouter:
    return SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, normalize=True, fp32_weights=True,
                             backend=backend)


def build(cfg: ModelConfig, experts: ExpertExecutor, backend: Backend | None = None) -> CausalLM:
    backend = backend or Backend()
    layers = [
        DecoderLayer(cfg, Attention(cfg, backend=backend), MoEBlock(router(cfg, backend), experts, i, cfg.num_experts),
                     backend)
        for i in range(cfg.num_layers)
    ]
    stack = DecoderStack(cfg, layers, RotaryEmbedding(cfg.rope, cfg.max_position_embeddings), backend)
    return CausalLM(cfg, stack, disk_renames={".mlp.gate.": ".block_sparse_moe.gate."})


ARCHITECTURE = Architecture(
    name="MixtralForCausalLM",
    parse_config=parse_config,
    build=build,
    expert_naming=ExpertNaming(
        gate="model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
        up="model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        down="model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
        fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
        fused_down="model.layers.{layer}.mlp.experts.down_proj",
    ),
)
