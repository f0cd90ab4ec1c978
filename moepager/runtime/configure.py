"""`--configure auto`: MoEpic's cache configurator online (MoEpic §3.4: reconfigure every τ = 5000 tokens).

It watches every decode token's routing (a routing observer: whole experts, as the router picks them) in a window
of the most recent tokens. Every `every` decode tokens, at the start of a pass (nothing pinned: the store awaits
what is in flight), it measures each layer's LRU hit curve on that window, runs the fixed-point budget exchange
(planning/configurator.py `vram_allocation`, the run's cost model's T values) and, when the chosen per-layer cache
sizes (and, on a split checkpoint, split ratios) differ from the store's and are modeled to save at least 1% of the
load time the current ones expose on the same window, applies them (`ExpertStore.reconfigure`:
what stays cached is kept, so the change reads nothing; the outputs do not change: tests/runtime/test_configure.py).
Each change is logged with what moved and the modeled load time per token it expects against the even split.

With a predictor's prefetch (`--predictor`), the configurator also sees each forecast the prefetcher acts on
(`predicted`) and measures MoEpic's prediction statistics online (§2.5) on the same window: P_i(y), how often the
y-th ranked expert was routed, and PH_i(y, C), how often it was in a cache of C experts, for the ranks the prefetcher
loads (its `--prefetch-k`; experts it gives no chance are not ranked). They give the objective its prefetch term
(eqs. 9-10), the one term through which a split can pay; without a predictor there is none, as nothing is
prefetched. The windows that term fills are the run's T_att and T_head (planning/configurator.py `layer_costs`, from
the checkpoint's dense weights).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch

from moepager.planning.configurator import LayerCosts, expert_split, statistics, vram_allocation
from moepager.store.budget import share_quotas
from moepager.store.keyspace import SplitParts
from moepager.store.store import ExpertStore
from moepager.types import PassInfo, RoutingDecision


class OnlineConfigurator:
    def __init__(self, store: ExpertStore, moe_layers: Sequence[int], num_experts: int, top_k: int, costs: LayerCosts,
                 every: int = 5000, window: int | None = None, zeta: float = 0.01, gain: float = 0.01,
                 log: Callable[[str], None] | None = None, ranked: int = 0):
        """`num_experts`, `top_k`: the router's (whole experts); the store's keys are parts when it holds split
        experts (`store.space`, store/keyspace.py). `window`: decode tokens the hit curves are measured on (default
        `every`). `ranked`: the forecast ranks the prediction statistics count (the prefetcher's experts per row; 0: no
        prefetch, no statistics)."""
        self.store, self.layers, self.costs = store, list(moe_layers), costs
        self.num_experts, self.top_k, self.every, self.zeta = num_experts, top_k, every, zeta
        self.gain = gain
        """The least share of the modeled exposed load time a change must save to be applied."""
        self.window = window or every
        self.column = {layer: i for i, layer in enumerate(self.layers)}
        self.ids_WLK = np.full((self.window, len(self.layers), top_k), -1, np.int64)
        self.ranked = min(ranked, num_experts)
        self.ranks_WLY = np.full((self.window, len(self.layers), self.ranked), -1, np.int64)
        """Each decode token's forecast ranks for each layer, most likely first (-1: no forecast, or no chance)."""
        self.forecasts: dict[tuple[int, int], np.ndarray] = {}
        """(pass id, MoE layer) -> ranks per row, until the layer routes in that pass."""
        self.pass_id = -1
        self.filled = self.next = self.since = self.rows = 0
        self.decoding = False
        self.log = log or (lambda line: print(line, file=sys.stderr))
        self.changes: list[str] = []
        """What each reconfiguration changed, in order (the lines logged)."""

    # -- the pass clock and the routing observer --------------------------------------------------------
    def begin_pass(self, info: PassInfo) -> None:
        self._advance()
        self.decoding = info.phase == "decode"
        self.pass_id = info.pass_id
        self.forecasts = {key: v for key, v in self.forecasts.items() if key[0] >= info.pass_id}
        if self.since >= self.every:
            self.since = 0
            self.reconfigure()

    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        return ()

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        if not self.decoding or route.ids_host_TK is None:
            return
        ids = route.ids_host_TK.numpy()
        rows = (self.next + np.arange(len(ids))) % self.window
        self.ids_WLK[rows, self.column[layer]] = ids
        self.rows = len(ids)
        if self.ranked:
            ranks = self.forecasts.pop((self.pass_id, layer), None)
            # a forecast of other rows (a request joined or left since it was made) ranks none of these tokens
            self.ranks_WLY[rows, self.column[layer]] = ranks if ranks is not None and len(ranks) == len(ids) else -1

    def predicted(self, pass_id: int, layer: int, probs_NE: torch.Tensor) -> None:
        """The prefetcher's forecast for `layer` in pass `pass_id`, a row per token (Prefetcher.on_forecast)."""
        top = torch.topk(probs_NE.float(), min(self.ranked, probs_NE.shape[1]), dim=1)
        ranks = np.full((len(probs_NE), self.ranked), -1, np.int64)
        ranks[:, : top.indices.shape[1]] = torch.where(top.values > 0, top.indices, -1).numpy()
        self.forecasts[(pass_id, layer)] = ranks

    def _advance(self) -> None:
        """The last pass's decode tokens join the window."""
        if self.rows:
            self.next = (self.next + self.rows) % self.window
            self.filled = min(self.window, self.filled + self.rows)
            self.since += self.rows
            self.rows = 0

    # -- choosing and applying ------------------------------------------------------------------------------
    def recent(self, ranks: bool = False) -> np.ndarray:
        """The window's routing, oldest token first ([S, L, K]); `ranks`: its forecast ranks ([S, L, Y])."""
        held = self.ranks_WLY if ranks else self.ids_WLK
        if self.filled < self.window:
            return held[: self.filled]
        return np.roll(held, -self.next, axis=0)

    def reconfigure(self) -> bool:
        """Choose each layer's cache size and split ratio on the window and apply them when they differ from the
        store's; returns whether anything changed."""
        store, parts, k = self.store, self.store.space.parts, self.top_k
        table = store.device.table
        total = table.capacity / parts  # whole experts' worth of cache
        if not self.filled or not k <= total / len(self.layers) <= self.num_experts:
            return False
        hit_LC, prediction = statistics(self.recent(), self.recent(ranks=True) if self.ranked else None,
                                        self.num_experts)
        split = parts > 1
        plan = vram_allocation(total, hit_LC, k, self.costs, self.zeta, prediction, split=split,
                               parts=parts if split else None)
        tops = [max(1, round(t * parts)) for t in plan.theta_L] if split else [1] * len(self.layers)
        quotas = share_quotas(plan.budgets_L.tolist(), table.capacity, [k * t for t in tops],
                              [self.num_experts * t for t in tops])
        before = [table.quota[layer] for layer in self.layers]
        space = store.space
        old_tops = [space.tops[layer] for layer in self.layers] if isinstance(space, SplitParts) else \
            [parts] * len(self.layers)
        now = expert_split(np.asarray(before) / parts, hit_LC, k, self.costs, prediction, split,
                           parts if split else None, [t / parts for t in old_tops])
        if (quotas == before and tops == old_tops) or plan.exposed_s >= now.exposed_s * (1 - self.gain):
            return False  # nothing to change, or too little to gain: no flapping between near-equal choices
        store.reconfigure(dict(zip(self.layers, quotas)), dict(zip(self.layers, tops)) if split else None)
        unit = " parts" if split else ""
        line = (f"configure: after {self.filled} decode tokens' routing, per-layer cache{unit} "
                f"{' '.join(map(str, before))} -> {' '.join(map(str, quotas))}"
                + (f", top parts {' '.join(map(str, old_tops))} -> {' '.join(map(str, tops))}" if split else "")
                + f" (modeled exposed load {1e3 * plan.exposed_s:.2f} ms a token, against {1e3 * now.exposed_s:.2f} "
                  f"as it was and {1e3 * plan.objectives[0]:.2f} split evenly"
                + (f"; prefetch modeled from forecasts naming {100 * prediction.accuracy_LY.sum(1).mean() / k:.0f}% "
                   "of routed experts" if prediction is not None else "") + ")")  # the exchange's start: even
        self.changes.append(line)
        self.log(line)
        return True
