"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): GQA with q/k/v biases, routed experts plus one shared
expert whose output is scaled by a sigmoid gate, sigmoid(x . w_gate) * shared(x).

Router: softmax (fp32) -> top-k -> optional renormalisation (`norm_topk_prob`) -> cast to activation dtype.
Layer i is sparse unless listed in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from moepager.errors import CheckpointError
from moepager.experts.executor import ExpertExecutor
from moepager.models.attention import Attention, RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.base import PER_EXPERT_MLP, Architecture, common_fields
from moepager.models.config import ModelConfig, get, rope_from_raw
from moepager.models.layers import CausalLM, DecoderLayer, DecoderStack, DenseMLP
from moepager.models.moe import MoEBlock, SoftmaxTopKRouter


class Qwen2MoEBlock(MoEBlock):
    def __init__(self, cfg: ModelConfig, experts: ExpertExecutor, layer: int, backend: Backend):
        router = SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k,
                                   normalize=bool(cfg.raw.get("norm_topk_prob", False)), fp32_weights=False,
                                   backend=backend)
        super().__init__(router, experts, layer, cfg.num_experts)
        self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def shared_output(self, x_ND: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x_ND)) * self.shared_expert(x_ND)


def sparse_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """Qwen's rule for which layers are MoE (shared by Qwen2-MoE and Qwen3-MoE)."""
    step = get(raw, "decoder_sparse_step", 1, kind=int)
    dense = set(get(raw, "mlp_only_layers", [], kind=list))
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def parse_qwen_config(raw: Mapping[str, Any], *, shared_expert: bool) -> ModelConfig:
    """Config of Qwen2-MoE (with its shared expert) or Qwen3-MoE (without)."""
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{raw['architectures'][0]} with use_sliding_window=true is not supported")
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
        shared_intermediate_size=get(raw, "shared_expert_intermediate_size", kind=int) if shared_expert else 0,
    )


def parse_config(raw: Mapping[str, Any]) -> ModelConfig:
    return parse_qwen_config(raw, shared_expert=True)


def build(cfg: ModelConfig, experts: ExpertExecutor, backend: Backend | None = None) -> CausalLM:
    backend = backend or Backend()
    qkv_bias = bool(cfg.raw.get("qkv_bias", True))
    layers = [
        DecoderLayer(cfg, Attention(cfg, qkv_bias=qkv_bias, backend=backend),
                     Qwen2MoEBlock(cfg, experts, i, backend) if i in cfg.moe_layers
                     else DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size), backend)
        for i in range(cfg.num_layers)
    ]
    rope = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)
    return CausalLM(cfg, DecoderStack(cfg, layers, rope, backend))


ARCHITECTURE = Architecture("Qwen2MoeForCausalLM", parse_config, build, PER_EXPERT_MLP)
