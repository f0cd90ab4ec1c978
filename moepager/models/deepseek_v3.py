"""DeepSeek-V3 (DeepseekV3ForCausalLM): the V2 body (MLA, first-k dense, shared experts) with the V3 router.

Router (DeepSeek-V3 §2.1.2): sigmoid scores in fp32; a per-expert correction bias is added for *choosing*
only; each of `n_group` groups is scored by the sum of its two best biased scores; the `topk_group` best
groups are kept; the top-k biased scores inside them pick the experts; weights are the unbiased scores,
renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moepager.experts.executor import ExpertExecutor
from moepager.models.backend import Backend
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.deepseek_v2 import build_deepseek
from moepager.models.layers import CausalLM
from moepager.models.specs import SPECS
from moepager.types import RoutingDecision


class DeepseekV3Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.top_k = cfg.top_k
        self.n_group, self.topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
        self.normalize = bool(raw.get("norm_topk_prob", True))
        self.scaling = float(raw.get("routed_scaling_factor") or 1.0)

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The decision's scores_TE alone (what gate lookahead applies to an earlier layer's input)."""
        return F.linear(x_ND.float(), self.weight.float()).sigmoid()

    def forward(self, x_ND: torch.Tensor) -> RoutingDecision:
        scores_NE = self.scores(x_ND)
        choice_NE = scores_NE + self.e_score_correction_bias.float()
        n, e = choice_NE.shape
        group_NG = choice_NE.view(n, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        keep_NG = torch.zeros_like(group_NG).scatter_(1, group_NG.topk(self.topk_group, dim=-1)[1], 1.0)
        keep_NE = keep_NG[:, :, None].expand(n, self.n_group, e // self.n_group).reshape(n, e)
        ids_NK = choice_NE.masked_fill(keep_NE == 0, float("-inf")).topk(self.top_k, dim=-1)[1]
        weights_NK = scores_NE.gather(1, ids_NK)
        if self.normalize:
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return RoutingDecision(ids_NK, weights_NK * self.scaling, scores_NE)




def build(cfg: ModelConfig, experts: ExpertExecutor, backend: Backend | None = None) -> CausalLM:
    return build_deepseek(cfg, experts, DeepseekV3Router, interleaved_rope=bool(cfg.raw.get("rope_interleave", True)),
                          backend=backend)


ARCHITECTURE = Architecture(SPECS["DeepseekV3ForCausalLM"], build)
