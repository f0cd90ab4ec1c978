"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM): MLA attention (q-LoRA optional), first-k dense layers,
routed + shared experts.

Router (DeepSeek-V2 §2.2): softmax over fp32 logits; `greedy` takes the top-k experts, `group_limited_greedy`
first keeps the `topk_group` groups (of `n_group`) with the highest max score and takes the top-k inside them;
weights optionally renormalised (`norm_topk_prob`), then multiplied by `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moepager.errors import CheckpointError
from moepager.experts.executor import ExpertExecutor
from moepager.models.attention import RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.layers import CausalLM, DecoderLayer, DecoderStack, DenseMLP
from moepager.models.mla import MLAttention
from moepager.models.moe import MoEBlock
from moepager.models.specs import SPECS
from moepager.types import RoutingDecision


class DeepseekV2Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.top_k
        self.method = raw.get("topk_method") or "greedy"
        if self.method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"DeepSeek-V2 topk_method '{self.method}' is not supported")
        self.n_group, self.topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
        self.normalize = bool(raw.get("norm_topk_prob", False))
        self.scaling = float(raw.get("routed_scaling_factor") or 1.0)

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The decision's scores_TE alone (what gate lookahead applies to an earlier layer's input)."""
        scores_NE = F.linear(x_ND.float(), self.weight.float()).softmax(dim=-1)
        if self.method == "group_limited_greedy":
            n = scores_NE.shape[0]
            group_NG = scores_NE.view(n, self.n_group, -1).max(dim=-1).values
            keep_NG = torch.zeros_like(group_NG).scatter_(1, group_NG.topk(self.topk_group, dim=-1)[1], 1.0)
            keep_NE = keep_NG[:, :, None].expand(n, self.n_group, scores_NE.shape[1] // self.n_group).reshape(n, -1)
            scores_NE = scores_NE.masked_fill(keep_NE == 0, 0.0)
        return scores_NE

    def forward(self, x_ND: torch.Tensor) -> RoutingDecision:
        scores_NE = self.scores(x_ND)
        weights_NK, ids_NK = torch.topk(scores_NE, self.top_k, dim=-1)
        if self.normalize and self.top_k > 1:
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return RoutingDecision(ids_NK, weights_NK * self.scaling, scores_NE)


class DeepseekMoEBlock(MoEBlock):
    """Routed experts plus `n_shared_experts` always-on experts fused into one MLP (both DeepSeek versions)."""

    def __init__(self, cfg: ModelConfig, router: nn.Module, experts: ExpertExecutor, layer: int):
        super().__init__(router, experts, layer, cfg.num_experts)
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_intermediate_size)

    def shared_output(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x_ND)




def build_deepseek(cfg: ModelConfig, experts: ExpertExecutor, router: type[nn.Module], interleaved_rope: bool,
                   backend: Backend | None) -> CausalLM:
    backend = backend or Backend()
    layers = [
        DecoderLayer(cfg, MLAttention(cfg, interleaved_rope=interleaved_rope, backend=backend),
                     DeepseekMoEBlock(cfg, router(cfg), experts, i) if i in cfg.moe_layers
                     else DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size), backend)
        for i in range(cfg.num_layers)
    ]
    rope = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)
    return CausalLM(cfg, DecoderStack(cfg, layers, rope, backend))


def build(cfg: ModelConfig, experts: ExpertExecutor, backend: Backend | None = None) -> CausalLM:
    return build_deepseek(cfg, experts, DeepseekV2Router, interleaved_rope=True, backend=backend)


ARCHITECTURE = Architecture(SPECS["DeepseekV2ForCausalLM"], build)
