"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): GQA with q/k/v biases, routed experts plus one shared
expert whose output is scaled by a sigmoid gate, sigmoid(x . w_gate) * shared(x).

Router: softmax (fp32) -> top-k -> optional renormalisation (`norm_topk_prob`) -> cast to activation dtype.
Layer i is sparse unless listed in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`.
"""

from __future__ import annotations

import torch
from torch import nn

from moepager.experts.executor import ExpertExecutor
from moepager.models.attention import Attention, RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.layers import CausalLM, DecoderLayer, DecoderStack, DenseMLP
from moepager.models.moe import MoEBlock, SoftmaxTopKRouter
from moepager.models.specs import SPECS


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


ARCHITECTURE = Architecture(SPECS["Qwen2MoeForCausalLM"], build)
