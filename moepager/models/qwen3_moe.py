"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA with per-head RMSNorm on q and k, routed experts only.

Router: softmax (fp32) -> top-k -> optional renormalisation (`norm_topk_prob`) -> cast to activation dtype.
"""

from __future__ import annotations

from moepager.experts.executor import ExpertExecutor
from moepager.models.attention import Attention, RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.layers import CausalLM, DecoderLayer, DecoderStack, DenseMLP
from moepager.models.moe import MoEBlock, SoftmaxTopKRouter
from moepager.models.specs import SPECS


def build(cfg: ModelConfig, experts: ExpertExecutor, backend: Backend | None = None) -> CausalLM:
    backend = backend or Backend()
    bias = bool(cfg.raw.get("attention_bias", False))
    normalize = bool(cfg.raw.get("norm_topk_prob", False))

    def mlp(i: int) -> MoEBlock | DenseMLP:
        if i not in cfg.moe_layers:
            return DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)
        router = SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, normalize=normalize,
                                   fp32_weights=False, backend=backend)
        return MoEBlock(router, experts, i, cfg.num_experts)

    layers = [DecoderLayer(cfg, Attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head", backend=backend), mlp(i),
                           backend)
              for i in range(cfg.num_layers)]
    rope = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)
    return CausalLM(cfg, DecoderStack(cfg, layers, rope, backend))


ARCHITECTURE = Architecture(SPECS["Qwen3MoeForCausalLM"], build)
