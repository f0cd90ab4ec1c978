"""A layer's (token, k) pairs sorted by expert: the first step of every executor (experts/executor.py) and of the
workers' share of a layer (experts/remote/worker.py). Stable by expert id, so each expert's rows keep token order; the
used experts and their row counts are read on the host once (the layer's one host sync)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moepager.types import RoutingDecision


@dataclass
class SortedTokens:
    """A layer's (token, k) pairs in expert order: M = N*K rows."""

    x_MD: torch.Tensor
    w_M1: torch.Tensor
    token_M: torch.Tensor
    """Which token of x_ND each sorted row is."""
    experts: list[int]
    """Distinct experts used, ascending (empty when the ids were never read on the host)."""
    starts: list[int]
    """Slice of sorted rows per used expert: starts[i]..starts[i+1]."""
    x_1D: torch.Tensor | None = None
    """The token itself when there is one (x_MD is then its expanded view, a slow GEMV operand: stride 0)."""

    def rows_of(self, which: Sequence[int]) -> torch.Tensor:
        """The sorted rows of experts `which` (indices into `experts`), on the host."""
        return torch.cat([torch.arange(self.starts[i], self.starts[i + 1]) for i in which])


def sorted_on_device(x_ND: torch.Tensor, route: RoutingDecision) -> tuple[SortedTokens, torch.Tensor]:
    """The sorted tokens without reading anything on the host, and the sorted expert id of every row."""
    ids_NK, weights_NK = route.ids_TK, route.weights_TK
    sorted_M, order_M = torch.sort(ids_NK.reshape(-1), stable=True)
    token_M = order_M // ids_NK.shape[1]
    work = SortedTokens(x_ND.index_select(0, token_M), weights_NK.reshape(-1, 1).index_select(0, order_M), token_M,
                        [], [])
    return work, sorted_M


def sort_by_expert(x_ND: torch.Tensor, route: RoutingDecision) -> SortedTokens:
    n, k = route.ids_TK.shape
    if n == 1:  # top-k ids are distinct: one row per expert, each row the one token (a view, not a copy)
        sorted_K, order_K = torch.sort(route.ids_TK[0])
        w_K1 = route.weights_TK[0].index_select(0, order_K)[:, None]
        experts = sorted(route.ids_host_TK[0].tolist()) if route.ids_host_TK is not None else sorted_K.tolist()
        return SortedTokens(x_ND.expand(k, -1), w_K1, order_K // k, experts, list(range(k + 1)), x_ND)
    work, sorted_M = sorted_on_device(x_ND, route)
    if route.ids_host_TK is not None:  # already on the host: no second copy (on CUDA, no second sync)
        used, counts = torch.unique(route.ids_host_TK, return_counts=True)  # sorted, as the device rows are
    else:
        used, counts = torch.unique_consecutive(sorted_M, return_counts=True)
    host = torch.cat((used, counts)).tolist()
    experts, counts_list = host[: len(used)], host[len(used):]
    starts = [0]
    for c in counts_list:
        starts.append(starts[-1] + c)
    work.experts, work.starts = experts, starts
    return work
