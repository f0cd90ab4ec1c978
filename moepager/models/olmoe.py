"""OLMoE (OlmoeForCausalLM): MHA with RMSNorm over the whole q and k projections (before the head split),
optional clipping of q/k/v to +-clip_qkv, 64 experts top-8, every layer sparse.

Router: softmax (fp32) -> top-k -> optional renormalisation (`norm_topk_prob`, off in OLMoE-1B-7B).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moepager.experts.executor import ExpertExecutor
from moepager.models.attention import Attention, RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.base import PER_EXPERT_MLP, Architecture, common_fields
from moepager.models.config import ModelConfig, get, rope_from_raw
from moepager.models.layers import CausalLM, DecoderLayer, DecoderStack
from moepager.models.moe import MoEBlock, SoftmaxTopKRouter


def parse_config(raw: Mapping[str, Any]) -> ModelConfig:
    fields = common_fields(raw, default_eps=1e-5, default_max_pos=4096)
    head_dim = fields["hidden_size"] // fields["num_heads"]
    return ModelConfig(
        **fields,
        head_dim=head_dim,
        rope=rope_from_raw(raw, head_dim),
        moe_layers=tuple(range(fields["num_layers"])),
        num_experts=get(raw, ("num_experts", "num_local_experts"), kind=int),
        top_k=get(raw, "num_experts_per_tok", kind=int),
        expert_intermediate_size=get(raw, "intermediate_size", kind=int),
        dense_intermediate_size=get(raw, "intermediate_size", kind=int),
    )


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


ARCHITECTURE = Architecture("OlmoeForCausalLM", parse_config, build, PER_EXPERT_MLP)
