"""Where a MoE block's routing comes from, and who sees it: routing sources (the block's own router, or a replay
of recorded routing) and routing observers (a trace recorder, a prefetcher).

An observer reads on the host what a block routed, and often more: the router's scores, its input, or a forecast
a predictor computes from them where they live. `stage` names those tensors while they are still only queued on
the device; `observe` copies them and the routed ids to the host together (types.to_host: on CUDA one host sync
for all of them, where a copy each would wait once each) and hands the copies to `routed`. So a paged MoE layer
waits for the device once, a predictor included (issue 15: at most one sync per MoE layer when paged).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from moepager.types import RoutingDecision, to_host


class RoutingObserver(Protocol):
    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        """The tensors `routed` will read on the host, made from the router's input and decision (work queued on
        the device, not waited for); called first, before the ids are copied."""
        ...

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        """Called by every MoE block before its experts run, with the router's input and decision, the decision's
        ids on the host (`route.ids_host_TK`: one copy for every observer and the executor) and host copies of
        what `stage` returned, in its order."""
        ...


class _NullObserver:
    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        return ()

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        return None


NULL_OBSERVER = _NullObserver()


def observe(observer: RoutingObserver, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> RoutingDecision:
    """`observer` sees layer `layer`'s decision: what it stages comes to the host with the routed ids, in one wait.
    Returns the decision with its ids on the host (for the executor too)."""
    staged = observer.stage(layer, x_ND, route)
    if route.ids_host_TK is None:
        ids_host_TK, *host = to_host(route.ids_TK, *staged)
        route = route._replace(ids_host_TK=ids_host_TK)
    else:
        host = to_host(*staged)
    observer.routed(layer, x_ND, route, host)
    return route


class RoutingFanOut:
    """Several observers (a trace recorder and a prefetcher), called in order; their staged tensors share the one
    copy to the host."""

    def __init__(self, observers: Sequence[RoutingObserver]):
        self.observers = list(observers)
        self._counts: list[int] = []

    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        staged: list[torch.Tensor] = []
        self._counts = []
        for observer in self.observers:
            mine = observer.stage(layer, x_ND, route)
            staged += mine
            self._counts.append(len(mine))
        return staged

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        offset = 0
        for observer, count in zip(self.observers, self._counts, strict=True):
            observer.routed(layer, x_ND, route, staged[offset:offset + count])
            offset += count


class RoutingSource(Protocol):
    def route(self, layer: int, gate: nn.Module, x_ND: torch.Tensor) -> RoutingDecision:
        """The routing decision of MoE layer `layer` for x_ND, whose router is `gate`."""
        ...


class _OwnRouter:
    def route(self, layer: int, gate: nn.Module, x_ND: torch.Tensor) -> RoutingDecision:
        return gate(x_ND)


OWN_ROUTER = _OwnRouter()
"""Every block routes with its own router (a replay of recorded routing replaces it: runtime/replay.py)."""
