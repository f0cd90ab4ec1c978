"""The MoE block, identical across architectures up to its router: router -> routed experts (the ExpertExecutor
seam) -> + shared experts; and the softmax top-k router most architectures use.

Shape legend: N tokens, D hidden, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moepager.experts.executor import ExpertExecutor
from moepager.models.backend import Backend
from moepager.models.graph_exit import moe_layer
from moepager.models.routing import NULL_OBSERVER, OWN_ROUTER, RoutingObserver, RoutingSource, observe
from moepager.types import RoutingDecision

NATIVE_BATCH_MAX_HIDDEN = 1024
"""The MoE block's native kernels on a few tokens (NATIVE_MAX_TOKENS) apply up to this hidden size (measured on the
built-in model's geometry only)."""


NATIVE_MAX_TOKENS = 16
"""A MoE block on up to this many tokens (a batch of decodes) computes its router and experts with torch's own kernels
too, the rest of the forward with oneDNN: at a few rows oneDNN wins the dense projections and loses the small router
and expert matrices."""


class MoEBlock(nn.Module):
    """Router -> routed experts through the `ExpertExecutor` seam (+ shared experts, in subclasses).

    `gate` is the architecture's router module (registered as `gate`, as in transformers); it maps x_ND to a
    RoutingDecision. The expert weights are not parameters of this module: `executor` holds them (resident,
    or paged through the expert store) and computes the layer's routed experts in one call.
    """

    def __init__(self, gate: nn.Module, experts: ExpertExecutor, layer: int, num_experts: int):
        super().__init__()
        self.gate = gate
        self.executor = experts
        self.layer = layer
        self.num_experts = num_experts
        self.observer: RoutingObserver = NULL_OBSERVER
        """Sees every routing decision (a trace recorder); the null one does nothing."""
        self.routing: RoutingSource = OWN_ROUTER
        """Decides the routing: the block's own router, or a replay of recorded routing."""
        self.graph_exit: int | None = None
        """A compiled step's handle for this block's host step (models/graph_exit.py; set when its experts are
        paged), None when the graph computes its experts itself."""
        self.has_shared = type(self).shared_output is not MoEBlock.shared_output
        """The architecture has always-on shared experts (it overrides `shared_output`)."""

    def shared_output(self, x_ND: torch.Tensor) -> torch.Tensor:
        """Output of always-on shared experts (architectures that have them override this)."""
        raise NotImplementedError

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled decode step (accel/compiled.py)
            route = self.gate(x_ND)
            if self.graph_exit is None:  # every expert resident: routed on the device, inside the graph
                out_ND = self.executor.run_on_device(self.layer, x_ND, route)  # type: ignore[attr-defined]
            else:  # paged: the routed experts leave the graph for the host (observers included)
                out_ND = moe_layer(x_ND, route.ids_TK, route.weights_TK, route.scores_TE, self.graph_exit)
            return out_ND + self.shared_output(x_ND) if self.has_shared else out_ND
        # A few tokens on the CPU: torch's own kernels for the router's and experts' small matrices (NATIVE_MAX_TOKENS)
        native = (x_ND.shape[0] <= NATIVE_MAX_TOKENS and x_ND.shape[1] <= NATIVE_BATCH_MAX_HIDDEN and not x_ND.is_cuda
                  and torch._C._get_mkldnn_enabled())
        if native:
            torch._C._set_mkldnn_enabled(False)
        try:
            route = self.gate(x_ND) if self.routing is OWN_ROUTER else self.routing.route(self.layer, self.gate, x_ND)
            # (host_step inlined where nothing observes: one Python call less per layer and token)
            out_ND = self.executor.run(self.layer, x_ND, route) if self.observer is NULL_OBSERVER else self.host_step(
                x_ND, route)
            return out_ND + self.shared_output(x_ND) if self.has_shared else out_ND
        finally:
            if native:
                torch._C._set_mkldnn_enabled(True)

    def host_step(self, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        """The routed experts' output: observers see the decision, then the executor computes it (the eager
        forward's step, and what a compiled paged step leaves its graph for: models/graph_exit.py)."""
        if self.observer is not NULL_OBSERVER:  # observers read the ids on the host, so does a paged executor:
            route = observe(self.observer, self.layer, x_ND, route)  # one copy for all of them
        return self.executor.run(self.layer, x_ND, route)


class SoftmaxTopKRouter(nn.Module):
    """Softmax over all experts (fp32), top-k, optional renormalisation of the k weights.

    Mixtral keeps the weights in fp32; Qwen-MoE and OLMoE cast them back to the activation dtype.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, normalize: bool, fp32_weights: bool,
                 backend: Backend | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.normalize, self.fp32_weights = top_k, normalize, fp32_weights
        self.backend = backend or Backend()
        """The model's backend: its `router_topk` (bf16 CPU runs) computes up to NATIVE_MAX_TOKENS bf16 tokens
        outside a compiled graph, one call where torch's are six."""

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The decision's scores_TE alone (what gate lookahead applies to an earlier layer's input)."""
        return torch.softmax(F.linear(x_ND, self.weight), dim=-1, dtype=torch.float32)

    def forward(self, x_ND: torch.Tensor) -> RoutingDecision:
        kernel = self.backend.router_topk
        if kernel is not None and x_ND.shape[0] <= NATIVE_MAX_TOKENS and x_ND.dtype is torch.bfloat16 \
                and not torch.compiler.is_compiling():
            ids_NK, weights_NK, probs_NE = kernel(x_ND, self.weight, self.top_k, self.normalize)
            return RoutingDecision(ids_NK, weights_NK if self.fp32_weights else weights_NK.to(x_ND.dtype), probs_NE)
        # `scores` written out: one Python call less per layer and token
        probs_NE = torch.softmax(F.linear(x_ND, self.weight), dim=-1, dtype=torch.float32)
        weights_NK, ids_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        if self.normalize:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return RoutingDecision(ids_NK, weights_NK if self.fp32_weights else weights_NK.to(x_ND.dtype), probs_NE)
