"""Mixtral (MixtralForCausalLM): GQA attention with optional sliding window, 8 SwiGLU experts, top-2.

Router: softmax over all experts in fp32, top-k, renormalise the k weights to sum to 1 (weights stay fp32).
Hub checkpoints name the MoE block `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down);
transformers' fused layout names it `mlp` with `gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

from moepager.experts.executor import ExpertExecutor
from moepager.models.attention import Attention, RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.layers import CausalLM, DecoderLayer, DecoderStack
from moepager.models.moe import MoEBlock, SoftmaxTopKRouter
from moepager.models.specs import SPECS


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


ARCHITECTURE = Architecture(SPECS["MixtralForCausalLM"], build)
