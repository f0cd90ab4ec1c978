"""MoEpic's cache configurator (MoEpic §3.4, Alg. 1): each MoE layer's memory budget V_i and split ratio θ_i.

An expert split at θ keeps its top segment (a share θ of its intermediate dimension) cached and loads the bottom
when it is needed, so a layer's budget of V_i experts' bytes holds the tops of C_i = V_i / θ_i experts. The
configurator chooses {V_i, θ_i} to minimise the load time compute cannot hide, Σ_i 𝒯^i:
- `expert_split` (eqs. 9-11): per layer, in layer order, the cache size C (θ = min(1, V_i / C)) that maximises m_i,
  the expected number of a token's K experts already resident (cached tops: K·H_i(C)·θ, plus what prefetching the
  predicted experts within the layer's window adds when prediction statistics are given); then
  𝒯^i = max(0, (K - m_i)·T_load - m_i·T_comp), and the next layer's window is T_moe - min(T_hide, T_miss) + T_att.
- `vram_allocation` (the greedy exchange): from the even split, move ζ·V_e of budget from the layer that loses
  least by giving it up to the layer that gains most by receiving it, while the sum of 𝒯^i strictly falls.

The search over C starts at floor(V_i), not MoEpic's ceil(V_i): whole experts at θ = 1 with a fraction of an expert
unused, so that a larger budget is never worse than a smaller one (with ceil, V = 4.3 must split 5 experts at
θ = 0.86 and can hold fewer hits than V = 4).

H_i(C), the share of layer i's activated experts found in a cache of C experts, is a statistic of the routing:
`hit_curves` measures it on a trace with LRU stack distances (an LRU cache's hit rate at every size at once;
MoEpic ranks by LCP priorities, which this approximates). Shape legend: L MoE layers, E experts, C cache sizes
0..E, K top-k, S steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moepager.errors import MoepagerError

if TYPE_CHECKING:
    from moepager.planning.cost import CostModel


@dataclass(frozen=True)
class LayerCosts:
    """Profiled times (seconds) the objective weighs (MoEpic's T values)."""

    load_s: float
    """T_load^exp: loading one whole expert."""
    compute_s: float
    """T_comp^exp: computing one expert for a decode token."""
    attention_s: float
    """T_comp^att: one MoE layer's attention (and the rest of its non-expert time)."""
    head_s: float = 0.0
    """T_comp^head: what runs before the first MoE layer (its prefetch window)."""


@dataclass(frozen=True)
class Prediction:
    """A predictor's statistics for the prefetch term (MoEpic §2.5); without them, nothing is prefetched."""

    accuracy_LY: np.ndarray
    """P_i(y): how often the expert ranked y-th by predicted score was activated (sums to K over y)."""
    cached_LYC: np.ndarray
    """PH_i(y, C): how often the expert ranked y-th was in a cache of C experts."""


@dataclass
class Plan:
    budgets_L: np.ndarray
    """V_i, in whole experts' bytes (fractions allowed: a budget of tops)."""
    theta_L: np.ndarray
    """θ_i: the cached share of each expert's intermediate dimension."""
    cached_L: np.ndarray
    """C_i = V_i / θ_i: experts whose tops the layer caches."""
    resident_L: np.ndarray
    """m_i: expected experts of a token's K resident when the layer routes."""
    exposed_L: np.ndarray
    """𝒯^i: the layer's load time compute does not hide."""
    objectives: list[float] = field(default_factory=list)
    """Σ 𝒯^i after each accepted move (the first: the even split's)."""

    @property
    def exposed_s(self) -> float:
        return float(self.exposed_L.sum())


def layer_costs(cost: CostModel, num_layers: int, layer_bytes: float = 0.0, head_bytes: float = 0.0) -> LayerCosts:
    """The configurator's T values from the cost model: an expert's load over the link, its compute for one token,
    and the windows' terms (MoEpic eq. 7): T_att, a MoE layer's non-expert time (attention, router, shared experts),
    and T_head, what runs between the last MoE layer and the next token's first (LM head, dense layers), the first
    layer's window. `layer_bytes`, `head_bytes`: the dense weights each reads (OpenCheckpoint.window_bytes).
    Calibrated: the measured non-expert decode time shared between them by those bytes (without them, evenly over the
    layers and no head); nominal: the bytes read at the device's memory speed (without them, the cost model's
    shared experts and `dense_bytes_per_layer`, and no head). The nominal terms leave out reading the KV cache."""
    load = cost.link.latency_s + cost.expert_bytes / cost.link.bytes_per_s
    compute = float(cost.compute_s(1.0))
    c = cost.calibration
    if c is not None:
        reads = num_layers * layer_bytes + head_bytes
        attention, head = ((c.dense_decode_s * layer_bytes / reads, c.dense_decode_s * head_bytes / reads) if reads
                           else (c.dense_decode_s / num_layers, 0.0))
    elif layer_bytes or head_bytes:
        attention, head = layer_bytes / cost.device.mem_Bps, head_bytes / cost.device.mem_Bps
    else:
        attention = cost.num_shared * compute + cost.dense_bytes_per_layer / cost.device.mem_Bps
        head = 0.0
    return LayerCosts(load_s=load, compute_s=compute, attention_s=float(attention), head_s=float(head))


def hit_curves(ids_SLK: np.ndarray, num_experts: int) -> np.ndarray:
    """H[L, C] for C = 0..E: the share of each layer's activations that an LRU cache of C experts would hold,
    from LRU stack distances over the steps of `ids_SLK` (negative ids: not recorded, skipped). Exact for the
    engine's and the simulator's LRU (policies/lru.py: ties between experts last used in the same step evicted lower
    id first), so a step's K experts are ranked among themselves too: an expert last used with others in one step is
    below those of them with a higher id (a cache of C >= K keeps the top C by (last step, id) after every step)."""
    return statistics(ids_SLK, None, num_experts)[0]


def statistics(ids_SLK: np.ndarray, ranks_SLY: np.ndarray | None, num_experts: int
               ) -> tuple[np.ndarray, Prediction | None]:
    """H[L, C] (`hit_curves`) and, given a predictor's ranked forecasts ranks_SLY (-1: none) for the same steps,
    its statistics P_i(y) (the y-th ranked expert was activated) and PH_i(y, C) (it was in an LRU cache of C
    experts when its layer routed), per step: MoEpic §2.5, with stack distances standing in for its shadow caches."""
    steps, num_layers, _ = ids_SLK.shape
    width = ranks_SLY.shape[2] if ranks_SLY is not None else 0
    last = np.full((num_layers, num_experts), -1, np.int64)
    depth_counts = np.zeros((num_layers, num_experts + 1), np.int64)  # depth E: never seen (always a miss)
    activated_LY = np.zeros((num_layers, width))
    cached_depth = np.zeros((num_layers, width, num_experts + 1), np.int64)
    rows = np.arange(num_layers)[:, None]

    experts_E = np.arange(num_experts)

    def depths(ids: np.ndarray) -> np.ndarray:
        seen = last[rows, np.where(ids >= 0, ids, 0)]
        later = last[:, None, :] > seen[:, :, None]  # distinct experts used since this one
        tied = (last[:, None, :] == seen[:, :, None]) & (experts_E > ids[:, :, None])  # same step, kept before it
        depth = (later | tied).sum(-1)
        return np.where((seen < 0) | (ids < 0), num_experts, depth)

    for s in range(steps):
        ids = ids_SLK[s]
        valid = ids >= 0
        if width:
            ranks = ranks_SLY[s]
            depth_Y = depths(ranks)
            np.add.at(cached_depth, (np.broadcast_to(rows, ranks.shape), np.arange(width)[None, :], depth_Y), 1)
            activated_LY += ((ranks[:, :, None] == ids[:, None, :]) & (ranks[:, :, None] >= 0)).any(-1)
        depth = depths(ids)
        np.add.at(depth_counts, (np.broadcast_to(rows, ids.shape)[valid], depth[valid]), 1)
        last[np.broadcast_to(rows, ids.shape)[valid], ids[valid]] = s
    total = np.maximum(depth_counts.sum(1, keepdims=True), 1)
    cumulative = np.cumsum(depth_counts, 1) / total  # share with depth <= d
    hit_LC = np.concatenate([np.zeros((num_layers, 1)), cumulative[:, :num_experts]], 1)  # hit at C: depth < C
    if not width:
        return hit_LC, None
    in_cache = np.cumsum(cached_depth, 2) / max(steps, 1)  # share of steps with depth <= d
    cached_LYC = np.concatenate([np.zeros((num_layers, width, 1)), in_cache[:, :, :num_experts]], 2)
    return hit_LC, Prediction(activated_LY / max(steps, 1), cached_LYC)


def candidates(v: float, num_experts: int, split: bool = True, parts: int | None = None,
               theta: float | None = None) -> list[tuple[int, float]]:
    """The (cache size C, split ratio θ) a layer's budget of `v` experts may take: C from floor(v) up with θ = v/C
    (see the module note); `split` False: whole experts only (C = floor(v), θ = 1); `parts`: θ a multiple of
    1/parts (a split checkpoint's granularity, C the most tops that fit); `theta`: that θ alone."""
    first = max(1, math.floor(v + 1e-9))
    if not split:
        return [(first, 1.0)]
    if theta is not None:
        return [(min(num_experts, max(first, math.floor(v / theta + 1e-9))), theta)]
    if parts is not None:
        out = []
        for t in range(parts, 0, -1):
            c = min(num_experts, math.floor(v * parts / t + 1e-9))
            if c >= 1 and (not out or c > out[-1][0]):
                out.append((c, t / parts))
        return out or [(first, 1.0)]
    return [(c, min(1.0, v / c)) for c in range(first, num_experts + 1)]


def expert_split(budgets_L: np.ndarray, hit_LC: np.ndarray, top_k: int, costs: LayerCosts,
                 prediction: Prediction | None = None, split: bool = True, parts: int | None = None,
                 theta: float | Sequence[float] | None = None) -> Plan:
    """MoEpic's ExpertSplit: each layer's best cache size C >= V_i for its budget, layer by layer (a layer's
    window depends on the layer before), among `candidates` (`split` False: whole experts only, what a store
    without split experts holds; `parts`, `theta`: see there; `theta` may give each layer its own)."""
    num_layers, sizes = hit_LC.shape
    num_experts = sizes - 1
    t_moe = top_k * costs.compute_s
    window = costs.head_s + costs.attention_s
    theta_L, cached_L, resident_L, exposed_L = (np.zeros(num_layers) for _ in range(4))
    for i in range(num_layers):
        v = float(budgets_L[i])
        best, best_c, best_t = -math.inf, num_experts, 1.0
        fixed = theta if theta is None or isinstance(theta, (int, float)) else float(theta[i])
        for c, t in candidates(v, num_experts, split, parts, fixed):
            m = top_k * hit_LC[i, c] * t
            if prediction is not None:
                m += _prefetched(prediction, i, c, t, costs.load_s, window)
            if m > best:
                best, best_c, best_t = m, c, t
        m = min(max(best, 0.0), float(top_k))
        hide, miss = m * costs.compute_s, (top_k - m) * costs.load_s
        theta_L[i], cached_L[i], resident_L[i] = best_t, best_c, m
        exposed_L[i] = max(0.0, miss - hide)
        window = (t_moe - min(hide, miss)) + costs.attention_s
    return Plan(np.asarray(budgets_L, np.float64).copy(), theta_L, cached_L, resident_L, exposed_L)


def _prefetched(prediction: Prediction, layer: int, c: int, theta: float, load_s: float, window: float) -> float:
    """The resident experts prefetching adds: the predicted experts in score order whose missing part (all of it,
    or the bottom of a cached one) loads within the window (eqs. 9-10)."""
    added, spent = 0.0, 0.0
    for y in range(prediction.accuracy_LY.shape[1]):
        missing = 1.0 - prediction.cached_LYC[layer, y, c] * theta
        if spent + missing * load_s > window:
            break
        spent += missing * load_s
        added += missing * prediction.accuracy_LY[layer, y]
    return added


def vram_allocation(total: float, hit_LC: np.ndarray, top_k: int, costs: LayerCosts, zeta: float = 0.01,
                    prediction: Prediction | None = None, max_moves: int = 100_000, split: bool = True,
                    parts: int | None = None, theta: float | None = None) -> Plan:
    """MoEpic's VramAllocation from the even split: each move raises the layer that gains most from ζ·total more
    and lowers the one that loses least from ζ·total less (never below the layer's top-k, what a decode step holds
    at once, nor past all of its experts), kept only while Σ 𝒯^i strictly falls. Σ V_i = total throughout."""
    num_layers, sizes = hit_LC.shape
    if not 0 < zeta < 1:
        raise MoepagerError(f"zeta must be in (0, 1), got {zeta}")
    if not top_k <= total / num_layers <= sizes - 1:
        raise MoepagerError(f"a budget of {total:.2f} experts over {num_layers} layers is not between one layer's "
                            f"top-{top_k} and all of its {sizes - 1} experts per layer")
    step = zeta * total if split else max(1.0, round(zeta * total))  # whole experts move whole
    budgets = np.full(num_layers, total / num_layers)
    if not split:
        budgets = np.floor(budgets)
    plan = expert_split(budgets, hit_LC, top_k, costs, prediction, split, parts, theta)
    history = [plan.exposed_s]
    for _ in range(max_moves):
        raised = expert_split(np.minimum(budgets + step, sizes - 1), hit_LC, top_k, costs, prediction, split, parts,
                              theta).exposed_L
        lowered = expert_split(np.maximum(budgets - step, top_k), hit_LC, top_k, costs, prediction, split, parts,
                               theta).exposed_L
        gain = np.where(budgets + step <= sizes - 1, plan.exposed_L - raised, -np.inf)
        i1 = int(np.argmax(gain))
        loss = np.where((budgets - step >= top_k - 1e-9) & (np.arange(num_layers) != i1), lowered - plan.exposed_L,
                        np.inf)
        i2 = int(np.argmin(loss))
        if not np.isfinite(gain[i1]) or not np.isfinite(loss[i2]):
            break
        moved = budgets.copy()
        moved[i1] += step
        moved[i2] -= step
        candidate = expert_split(moved, hit_LC, top_k, costs, prediction, split, parts, theta)
        if candidate.exposed_s >= plan.exposed_s:
            break  # no strict improvement: the allocation is a fixed point
        budgets, plan = moved, candidate
        history.append(plan.exposed_s)
    plan.objectives = history
    return plan
