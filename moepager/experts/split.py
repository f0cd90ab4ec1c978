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
        ids = self._parts_of(route.ids_TK)
        host = route.ids_host_TK
        if host is not None:  # on the CPU the host ids are the ids themselves: expanded once
            host = ids if host is route.ids_TK else self._parts_of(host)
        weights = route.weights_TK.unsqueeze(-1).expand(-1, -1, self.parts).flatten(1)
        return RoutingDecision(ids, weights, route.scores_TE, host)

    def _parts_of(self, ids_TK: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, K] as their parts' ids [T, K·S] (e·S + j, ascending per expert)."""
        offsets = self._offsets.get(ids_TK.device)
        if offsets is None:
            offsets = self._offsets[ids_TK.device] = torch.arange(self.parts, device=ids_TK.device)
        return (ids_TK.unsqueeze(-1) * self.parts + offsets.to(ids_TK.dtype)).flatten(1)

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        return self.inner.run(layer, x_ND, self.route(route))
