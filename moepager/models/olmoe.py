"""OLMoE (OlmoeForCausalLM): MHA with RMSNorm over the whole q and k projections (before the head split),
optional clipping of q/k/v to +-clip_qkv, 64 experts top-8, every layer sparse.

Router: softmax (fp32) -> top-k -> optional renormalisation (`norm_topk_prob`, off in OLMoE-1B-7B).
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


def build(cfg: ModelConfig, experts: ExpertExecutor, backend: Backend | None = None) -> CausalLM:
    backend = backend or Backend()
    bias = bool(cfg.raw.get("attention_bias", False))
    clip = cfg.raw.get("clip_qkv")
    normalize = bool(cfg.raw.get("norm_topk_prob", False))
    layers = [
        DecoderLayer(cfg, Attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=clip, backend=backend),
                     MoEBlock(SoftmaxTopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, normalize=normalize,
                                                fp32_weights=False, backend=backend), experts, i, cfg.num_experts),
                     backend)
        for i in range(cfg.num_layers)
    ]
    rope = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)
    return CausalLM(cfg, DecoderStack(cfg, layers, rope, backend))


ARCHITECTURE = Architecture(SPECS["OlmoeForCausalLM"], build)
