"""Computing routed experts and summing their outputs in a fixed order.

Algorithm: sort the T*K (token, slot) pairs by expert id (stable), gather the tokens once, run each used
expert on its contiguous slice, scale by the routing weight, and `index_add_` everything into the output.
Experts are visited in ascending id order whatever the source or cache state, so the floating-point sum is
the same in every run (and the same order transformers uses): offloading stays bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moepager.experts.protocols import ExpertSource
from moepager.experts.weights import AnyExpertWeights
from moepager.types import RoutingDecision


def expert_forward(x_TD: torch.Tensor, w: AnyExpertWeights, act: Callable[[torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:
    """SwiGLU expert: down(act(gate x) * up x)."""
    gate_TF, up_TF = w.gate_up(x_TD).chunk(2, dim=-1)
    return w.down(act(gate_TF) * up_TF)


def combine_experts(x_TD: torch.Tensor, route: RoutingDecision, source: ExpertSource, layer: int,
                    num_experts: int, act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """Sum over each token's K experts of weight * expert(token), experts fetched from `source`."""
    ids_TK, weights_TK = route.ids_TK, route.weights_TK
    k = ids_TK.shape[1]
    flat_ids = ids_TK.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    used = [e for e, c in enumerate(counts) if c]
    token_idx = order // k
    x_sorted = x_TD[token_idx]
    w_sorted = weights_TK.reshape(-1)[order, None]
    outputs = []
    start = 0
    for e, weights in zip(used, source.stream(layer, used), strict=True):
        end = start + counts[e]
        outputs.append(expert_forward(x_sorted[start:end], weights, act) * w_sorted[start:end])
        start = end
    out_TD = torch.zeros_like(x_TD)
    out_TD.index_add_(0, token_idx, torch.cat(outputs).to(x_TD.dtype))
    return out_TD
