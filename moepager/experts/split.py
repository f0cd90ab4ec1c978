"""Executing split experts (MoEpic §3.2; the checkpoint: checkpoints/split.py).

A split checkpoint stores expert e of a layer as S parts e·S + j; the router still picks K of the E experts.
`SplitExecutor` sits behind the executor seam: it routes each token to all S parts of each of its experts with the
expert's weight and hands that routing to the executor that holds the parts (resident, or paged through the store,
which caches each layer's top parts and streams its bottom ones), so a part is computed the moment it is there: the
top of a cached expert while its bottom is still being read. Every token then sums its K·S weighted parts in
ascending (expert, part) order, the same order wherever the parts came from, so a split run gives the same output
resident or paged, at any split ratio and budget (bit for bit), and the unsplit model's to rounding.
"""

from __future__ import annotations

import torch

from moepager.experts.executor import ExpertExecutor
from moepager.types import RoutingDecision


class SplitExecutor:
    def __init__(self, inner: ExpertExecutor, parts: int):
        self.inner = inner
        """The executor of the parts, as experts e·parts + j."""
        self.parts = parts
        self.compute_note = inner.compute_note
        self._offsets: dict[torch.device, torch.Tensor] = {}

    def route(self, route: RoutingDecision) -> RoutingDecision:
        """Each token's K experts as its K·S parts, every part weighted as its expert."""
        s = self.parts
        offsets = self._offsets.get(route.ids_TK.device)
        if offsets is None:
            offsets = self._offsets[route.ids_TK.device] = torch.arange(s, device=route.ids_TK.device)
        ids = (route.ids_TK.unsqueeze(-1) * s + offsets.to(route.ids_TK.dtype)).flatten(1)
        weights = route.weights_TK.unsqueeze(-1).expand(-1, -1, s).flatten(1)
        host = None
        if route.ids_host_TK is not None:
            host = (route.ids_host_TK.unsqueeze(-1) * s + torch.arange(s, dtype=route.ids_host_TK.dtype)).flatten(1)
        return RoutingDecision(ids, weights, route.scores_TE, host)

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        return self.inner.run(layer, x_ND, self.route(route))
