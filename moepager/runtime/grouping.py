"""ExpertFlow's token scheduler (§3.3.3): sequences grouped by the similarity of their routing paths, so that each
decode step activates fewer distinct experts.

A sequence's path is the set of experts its next token is expected to use at every MoE layer, a bit per (layer,
expert). `PathTracker` takes it from the run's `--predictor` where that forecasts every MoE layer at the next token
(ExpertFlow's own path predictor, `--predictor path`, forecasts it from the tokens; any fitted predictor does), else
keeps each running request's last token's routing as that forecast (routing has token-to-token locality).
`balanced_two_means` splits paths into two groups of sizes ceil(n/2) and floor(n/2) by balanced 2-means on Hamming
similarity (eq. 6, S[i, j] = 1 - Hamming(r_i, r_j) / (L E)):
1. medoids: the oldest sequence, and the one least similar to it (ties: the older);
2. assign: sort by S[i, c1] - S[i, c2], descending (stable: older first on ties); the first ceil(n/2) form group 1;
3. each group's new medoid is its member most similar on average to the others (ties: the older);
4. repeat 2-3 until the groups stop changing, at most `iters` times.
Deterministic: the same paths give the same groups. The objective is the sum over the two groups of their distinct
(layer, expert) pairs (eq. 4-5 with the union, as the digest corrects).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from moepager.predictors.base import Forecast
from moepager.types import PassInfo, RoutingDecision

ITERATIONS = 10
"""Most rounds of 2-means (the paper leaves it open; a handful settle on every trace tried)."""


def similarity(paths_NP: np.ndarray) -> np.ndarray:
    """S[i, j] = 1 - Hamming(path_i, path_j) / P for boolean paths [N, P]."""
    r = paths_NP.astype(np.float32)
    hamming = r @ (1 - r).T + (1 - r) @ r.T
    return 1 - hamming / max(paths_NP.shape[1], 1)


def union_size(paths_NP: np.ndarray, members: Sequence[int]) -> int:
    """Distinct (layer, expert) pairs the `members` activate together."""
    return int(paths_NP[list(members)].any(0).sum()) if len(members) else 0


def balanced_two_means(paths_NP: np.ndarray, iters: int = ITERATIONS) -> tuple[list[int], list[int]]:
    """Rows of `paths_NP` split into two groups of ceil(n/2) and floor(n/2), each in ascending order (module note)."""
    n = len(paths_NP)
    if n < 2:
        return list(range(n)), []
    s = similarity(paths_NP)
    c1 = 0
    c2 = int(np.argmin(np.where(np.arange(n) == c1, np.inf, s[c1])))
    half = (n + 1) // 2
    groups: tuple[list[int], list[int]] | None = None
    for _ in range(iters):
        order = np.argsort(-(s[:, c1] - s[:, c2]), kind="stable")
        new = (sorted(order[:half].tolist()), sorted(order[half:].tolist()))
        if new == groups:
            break
        groups = new
        c1, c2 = (_medoid(s, g) for g in groups)
    assert groups is not None
    return groups


def path_of(ids_LK: np.ndarray, num_experts: int) -> np.ndarray:
    """One token's path: a bit per (layer, expert) it routes to, [L * E] (negative ids: not recorded, left out)."""
    path = np.zeros((len(ids_LK), num_experts), bool)
    for layer, ids in enumerate(ids_LK):
        path[layer, ids[ids >= 0]] = True
    return path.reshape(-1)


def _medoid(s: np.ndarray, members: list[int]) -> int:
    """The member most similar on average to the others (the first on ties)."""
    block = s[np.ix_(members, members)]
    return members[int(np.argmax(block.sum(1)))]


class PathTracker:
    """Each running request's latest token's routing over every MoE layer, as a path (a routing observer and a pass
    part: runtime/llm.py plugs it in when the engine's batch policy groups by paths)."""

    def __init__(self, moe_layers: Sequence[int], num_experts: int,
                 forecast: Callable[[int, int], Forecast | None] | None = None, top_k: int = 0):
        """`forecast(position, 1)`: a predictor's forecast of each MoE position at the rows' next tokens (the run's
        `--predictor`, which observes each layer before this tracker does); when it has one for every position, a
        request's path is its `top_k` experts there, else its last routed token's."""
        self.column = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.forecast, self.top_k = forecast, top_k
        self.paths: dict[int, np.ndarray] = {}
        """request id -> bool [L * E]: the experts its next token is expected to use."""
        self.forecast_passes = 0
        """Passes whose paths came from the predictor's forecasts (the rest: from the routing)."""
        self._info: PassInfo | None = None
        self._last_rows: np.ndarray | None = None
        self._pending: dict[int, np.ndarray] = {}
        self._forecast: np.ndarray | None = None

    def begin_pass(self, info: PassInfo) -> None:
        self._flush()
        self._info = info
        ends = np.cumsum(info.counts)
        self._last_rows = ends - 1  # MoE blocks see the valid tokens row-major: a row's last token ends its span

    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        return ()

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        if self._last_rows is None or route.ids_host_TK is None:
            return
        column = self.column[layer]
        self._pending[column] = route.ids_host_TK.numpy()[self._last_rows]
        if self.forecast is not None and column == len(self.column) - 1:  # every layer observed: the next token's
            rows = self._last_rows.tolist()
            forecasts = [self.forecast(j, 1) for j in range(len(self.column))]
            self._forecast = np.stack([f.rows(rows).top(self.top_k).cpu().numpy() for f in forecasts], 1) \
                if all(f is not None for f in forecasts) else None  # type: ignore[union-attr]

    def _flush(self) -> None:
        info, pending = self._info, self._pending
        if info is None or len(pending) != len(self.column):
            self._pending = {}
            return
        ids_RLK = np.stack([pending[column] for column in range(len(self.column))], 1)
        if self._forecast is not None:
            ids_RLK = self._forecast
            self.forecast_passes += 1
        for row, request in enumerate(info.requests):
            self.paths[request] = path_of(ids_RLK[row], self.num_experts)
        self._pending, self._info, self._forecast = {}, None, None

    def path(self, request: int) -> np.ndarray | None:
        """The request's latest path (its last pass's routing), or None before it has routed."""
        self._flush()
        return self.paths.get(request)

    def forget(self, request: int) -> None:
        self._flush()  # its last pass first, so that nothing brings it back
        self.paths.pop(request, None)
