"""Trace-driven cache simulator: replays a workload against a policy and counts hits, misses and transfers.

It runs the same policy objects as the engine (their vectorised `priority`), on per-layer caches (`capacity`
experts in each layer) or one global cache (`capacity` experts shared by all layers), with the engine's
semantics, so a trace the engine recorded gives the engine's hits and misses (tests/trace/test_agreement.py):
- a step (forward pass) requests, per layer, the distinct experts its tokens chose; all are protected while
  the layer runs; misses are loaded, each evicting the lowest-priority unprotected expert of the layer (layer
  scope) or of any layer (global scope, layers in order); ties go to the lower (layer, expert);
- the clock is the step index; statistics (count, last) persist across evictions;
- a step that needs more distinct experts in a layer than its cache holds keeps its hits and, of its misses,
  the first that fit in ascending id; the rest stream through uncached (the engine's stream rows), loaded
  all the same (prefill steps and large batches do this).
Policies driven with `admits_on_miss` False (SMoE, see DRIVES) never load on a miss (the expert runs on the CPU);
after each step they load what `admissions` picks from the forecast ranking, evicting by priority.
Hybrid execution (`SimSpec.execution`, the engine's `--execution hybrid`: experts/hybrid.py) places each missing
expert by its token count in the step: one with at least `device_tokens` tokens is loaded (and admitted) as above,
one with fewer is computed on the CPU (`cpu_SL`): nothing loaded, nothing admitted.

Speed: per-layer caches are replayed with one set of array operations per step over all layers at once;
the global cache needs one per (step, layer). Policies must be elementwise: an expert's priority depends
only on its own statistics and the step.
Shape legend: S steps, L layers, E experts (+1 sink column for MISSING ids), K top-k, R ranking length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from moepager.policies import make_policy
from moepager.policies.base import AccessStats, Ranked
from moepager.trace.format import MISSING, PREFILL, TraceError, TraceHeader
from moepager.trace.workload import Workload
from moepager.types import Scope

ForecastKind = Literal["none", "repeat", "oracle", "prior", "predictor"]
FORECASTS: tuple[ForecastKind, ...] = ("none", "repeat", "oracle", "prior", "predictor")
Progress = Callable[[int], None]


@dataclass(frozen=True)
class Drive:
    """How the simulator drives a policy beyond its ranking: placement and prefetch, not eviction order."""

    offline: bool = False
    """It needs the future (`next_use`): simulator only."""
    preload: bool = False
    """The cache starts full of the experts with the highest prior."""
    admits_on_miss: bool = True
    """A missed expert is loaded into the cache (False: it is computed elsewhere, e.g. on the CPU, and only the
    policy's `admissions` from the forecast change the cache)."""


DRIVES: dict[str, Drive] = {
    "belady": Drive(offline=True),
    "static-hot": Drive(preload=True),
    "smoe-fixed": Drive(admits_on_miss=False),
    "smoe-adaptive": Drive(admits_on_miss=False),
}
"""Policies the simulator drives other than as a plain cache that admits every miss."""


def drive_of(policy: str) -> Drive:
    return DRIVES.get(policy, Drive())


@dataclass(frozen=True)
class SimSpec:
    policy: str
    capacity: int
    """Cached experts per layer (scope "layer") or in total (scope "global")."""
    scope: Scope = "layer"
    forecast: ForecastKind = "none"
    """What fMoE's probabilities and SMoE's prefetch ranking come from: the current step's experts
    (`repeat`), the true next step's (`oracle`, an upper bound), the prior's frequencies (`prior`), or none."""
    seed: int = 0
    warm: bool = False
    """Start with the cache full the way the engine's warm start fills it (expert 0 of every layer, then expert
    1, ...: experts 0..capacity-1 of each layer in layer scope) instead of empty."""
    prefetch: int = 0
    """Experts per token and layer loaded from a fitted predictor's forecast before the layer runs (PLEC's
    layer-order prefetch; needs forecast "predictor" with prefetch ranks); 0: none."""
    per_layer: tuple[int, ...] | None = None
    """Layer scope: each MoE layer's own capacity (a configured split of the budget: planning/configurator.py);
    None: `capacity` for every layer."""
    execution: Literal["gpu", "hybrid"] = "gpu"
    """gpu: every miss is loaded; hybrid: a miss with fewer than `device_tokens` tokens is computed on the CPU."""
    hybrid_prefill: Literal["ping-pong", "cache"] = "ping-pong"
    """Hybrid, as the engine's `--hybrid-prefill`: ping-pong, a prefill step's heavy misses are loaded but not
    admitted (they pass through the stream rows), and the first decode step after prefill steps first loads each
    layer's most activated experts of those steps (ties: the lower id) into its cache, ahead (SMoE's initial decode
    cache); cache, they are admitted as a decode's are."""
    device_tokens: int | None = None
    """Hybrid: the fewest tokens in a step that make a missing expert worth copying (the cost model's
    `ExpertTimes.threshold`); None: every missing expert is computed on the CPU."""
    admit: int = 0
    """Hybrid: up to this many of a layer's experts computed on the CPU (the lowest ids) are then copied to the device
    in the background (loads ahead of their next use, evicting by the policy), so the cache follows the routing as
    gpu execution's does at a bounded cost of the link; 0: none."""
    horizon: int = 1
    """With forecast `oracle`: the true experts of the next `horizon` steps, not only the next one's (ranked by how
    often the window uses them, each with the same probability, so PLEC-LRFU breaks their ties by the CRF): what a
    perfect forecast that many tokens ahead would be worth to eviction."""

    @property
    def label(self) -> str:
        extra = f"/{self.forecast}" if self.forecast != "none" else ""
        extra += f"{self.horizon}" if self.horizon > 1 else ""
        extra += f"+pf{self.prefetch}" if self.prefetch else ""
        extra += (f"/hybrid+admit{self.admit}" if self.admit else "/hybrid") if self.execution == "hybrid" else ""
        return f"{self.policy}{extra}@{self.capacity}{'g' if self.scope == 'global' else ''}"


@dataclass
class SimResult:
    spec: SimSpec
    requested_SL: np.ndarray
    """Distinct experts each step requested per layer."""
    hits_SL: np.ndarray
    demand_loads_SL: np.ndarray
    """Experts loaded on a miss (admitted to the cache, or streamed through when it has no room)."""
    prefetch_loads_SL: np.ndarray
    """Experts loaded ahead of use (SMoE's token-wise prefetch)."""
    prefetch_used_SL: np.ndarray
    """Of those, the ones their step then requested (a hit that still cost a transfer)."""
    cpu_SL: np.ndarray
    """Missing experts computed on the CPU without a transfer (hybrid execution)."""
    step_phase: np.ndarray
    step_tokens: np.ndarray
    """Tokens in each step."""
    wall_s: float

    def hit_rate(self, phase: int | None = None) -> float:
        rows = slice(None) if phase is None else self.step_phase == phase
        requested = int(self.requested_SL[rows].sum())
        return float(self.hits_SL[rows].sum()) / requested if requested else float("nan")

    def layer_hit_rates(self) -> np.ndarray:
        return self.hits_SL.sum(0) / np.maximum(self.requested_SL.sum(0), 1)

    @property
    def misses(self) -> int:
        return int((self.requested_SL - self.hits_SL).sum())

    @property
    def loads(self) -> int:
        return int(self.demand_loads_SL.sum() + self.prefetch_loads_SL.sum())


@dataclass(frozen=True)
class Forecasts:
    """A fitted predictor's forecasts replayed from a trace (trace/predict.py forecast_ranks), per token of the
    workload: experts ranked most likely first, -1 where there is none."""

    next_NLR: np.ndarray | None = None
    """For token n's *next* token at each layer, made once token n's layer has routed (what eviction ranks by:
    the predicted next use)."""
    ahead_NLR: np.ndarray | None = None
    """For token n itself at each layer, made before that layer runs (what prefetch loads)."""


class SimForecast:
    """Per step, a ranking `[L, R]` of the experts the next step is expected to use per layer, and from it
    fMoE's probabilities `[L, E+1]` (1/R on the ranked experts, or the prior's normalised frequencies)."""

    def __init__(self, kind: ForecastKind, work: Workload, ids_NLK: np.ndarray, prior_LE: np.ndarray | None,
                 replayed: Forecasts | None = None, horizon: int = 1):
        self.kind, self.work, self.ids_NLK, self.replayed, self.horizon = kind, work, ids_NLK, replayed, horizon
        num_layers, e = work.header.num_layers, work.header.num_experts
        if kind == "prior":
            if prior_LE is None:
                raise TraceError("forecast 'prior' needs a prior (--prior)")
            self._static_ranked = np.argsort(-prior_LE, axis=1, kind="stable")
            total = prior_LE.sum(1, keepdims=True)
            self._static_prob = np.zeros((num_layers, e + 1))
            self._static_prob[:, :e] = prior_LE / np.where(total > 0, total, 1.0)
        self._prob = np.zeros((num_layers, e + 1))
        self._rows_L1 = np.arange(num_layers)[:, None]

    def ranked(self, step: int) -> np.ndarray:
        if self.kind == "prior":
            return self._static_ranked
        if self.kind == "none":
            raise TraceError("this policy needs a forecast of the next step's experts (--forecast)")
        if self.kind == "predictor":
            assert self.replayed is not None and self.replayed.next_NLR is not None
            return self._union(self.replayed.next_NLR, step)
        source = step if self.kind == "repeat" else step + 1
        if source >= self.work.num_steps:
            return np.full((len(self._rows_L1), 1), -1)
        last = source if self.kind == "repeat" else min(step + self.horizon, self.work.num_steps - 1)
        return self._union(self.ids_NLK, source, last)

    def ahead(self, step: int, width: int) -> np.ndarray:
        """The `width` experts per layer to prefetch before `step` runs (-1: none), from the replayed forecast."""
        assert self.replayed is not None and self.replayed.ahead_NLR is not None
        ranked = self._union(self.replayed.ahead_NLR[:, :, :width], step)
        return ranked[:, : width * (self.work.step_ptr[step + 1] - self.work.step_ptr[step])]

    def _union(self, ids_NLX: np.ndarray, step: int, last: int | None = None) -> np.ndarray:
        """The rankings per layer of the tokens of steps `step`..`last` (default: `step` alone): one token's as it
        is, several by how many tokens name each."""
        end = step if last is None else last
        toks = self.work.step_tokens[self.work.step_ptr[step]:self.work.step_ptr[end + 1]]
        ids = ids_NLX[toks].astype(np.int64)
        if len(toks) == 1:
            ranked = ids[0].copy()
        else:
            e = self.work.header.num_experts
            counts = np.zeros((len(self._rows_L1), e + 2), np.int64)
            np.add.at(counts, (self._rows_L1[None], ids), 1)
            ranked = np.argsort(-counts[:, :e], axis=1, kind="stable")
            ranked[np.take_along_axis(counts[:, :e], ranked, 1) == 0] = -1
        ranked[(ranked >= self.work.header.num_experts) | (ranked < 0)] = -1
        return ranked

    def prob(self, step: int) -> np.ndarray:
        if self.kind == "none":
            return np.full_like(self._prob, np.nan)
        if self.kind == "prior":
            return self._static_prob
        ranked = self.ranked(step)
        self._prob[:] = 0.0
        valid = ranked >= 0
        width = np.maximum(valid.sum(1, keepdims=True), 1)
        self._prob[np.broadcast_to(self._rows_L1, ranked.shape)[valid], ranked[valid]] = np.broadcast_to(
            1.0 / width, ranked.shape)[valid]
        return self._prob


def check_spec(spec: SimSpec, h: TraceHeader, prior_LE: np.ndarray | None) -> None:
    """Everything `simulate` would refuse about `spec`, checked before any replay runs."""
    try:
        make_policy(spec.policy, seed=spec.seed)
    except ValueError as e:
        raise TraceError(str(e)) from None
    drive = drive_of(spec.policy)
    most = h.num_experts if spec.scope == "layer" else h.num_experts * h.num_layers
    where = "per layer" if spec.scope == "layer" else "in all"
    if spec.per_layer is not None and (spec.scope != "layer" or len(spec.per_layer) != h.num_layers
                                       or not all(h.top_k <= c <= h.num_experts for c in spec.per_layer)):
        raise TraceError(f"per-layer capacities need scope 'layer', one for each of the {h.num_layers} layers, each "
                         f"between the top-{h.top_k} and the {h.num_experts} experts of a layer")
    if spec.capacity < 1 or (spec.capacity < h.top_k and spec.execution != "hybrid"):
        # (hybrid execution needs no slot per routed expert: what misses computes on the CPU or passes through the
        # two stream rows uncached, as in the engine, so SMoE's budgets below the top-k replay)
        least = 1 if spec.execution == "hybrid" else h.top_k
        raise TraceError(f"capacity {spec.capacity} experts {where} is below one token's top-{h.top_k}; use at "
                         f"least {least}" + (" (or --execution hybrid)" if least > 1 else ""))
    if spec.capacity > most:
        raise TraceError(f"capacity {spec.capacity} experts {where} is more than the trace has ({most}); use at "
                         f"most {most}")
    if (drive.preload or spec.forecast == "prior") and prior_LE is None:
        raise TraceError(f"policy '{spec.policy}' with forecast '{spec.forecast}' needs a prior (--prior)")
    if not drive.admits_on_miss and spec.forecast == "none":
        raise TraceError(f"policy '{spec.policy}' prefetches from a forecast of the next step: give --forecast "
                         f"repeat, oracle or prior")
    if not drive.admits_on_miss and spec.scope != "layer":
        raise TraceError(f"policy '{spec.policy}' manages fixed per-layer slots; use scope 'layer'")
    if prior_LE is not None and prior_LE.shape != (h.num_layers, h.num_experts):
        raise TraceError(f"prior shape {prior_LE.shape} does not match the trace ({h.num_layers}, {h.num_experts})")
    if spec.prefetch and (spec.forecast != "predictor" or spec.scope != "layer" or not drive.admits_on_miss):
        raise TraceError("prefetch replays a fitted predictor's forecasts (--forecast predictor) into per-layer "
                         f"caches of a policy that admits misses; not '{spec.policy}' with forecast "
                         f"'{spec.forecast}' in scope '{spec.scope}'")
    if spec.horizon < 1:
        raise TraceError(f"a forecast horizon must be 1 step or more, got {spec.horizon}")
    if spec.horizon > 1 and spec.forecast != "oracle":
        raise TraceError(f"a forecast horizon of {spec.horizon} steps needs forecast 'oracle', not "
                         f"'{spec.forecast}' (only the true future reaches further than the next step)")
    if spec.execution == "hybrid" and (not drive.admits_on_miss or spec.scope != "layer"):
        raise TraceError(f"hybrid execution places the misses of per-layer caches that admit them; not '{spec.policy}' "
                         f"in scope '{spec.scope}'")
    if spec.prefetch < 0 or spec.prefetch > spec.capacity:
        raise TraceError(f"prefetch {spec.prefetch} experts must be between 0 and the capacity {spec.capacity}")


def check_replayed(spec: SimSpec, replayed: Forecasts | None, num_tokens: int) -> None:
    """A replayed forecast is there when the spec asks for one, and covers the workload's tokens."""
    if spec.forecast != "predictor":
        return
    if replayed is None or replayed.next_NLR is None:
        raise TraceError("forecast 'predictor' needs a fitted predictor's forecasts (--predictor NAME "
                         "--predictor-file PATH)")
    if spec.prefetch and replayed.ahead_NLR is None:
        raise TraceError("prefetch needs the predictor's forecasts ahead of each layer (--prefetch-distance)")
    for name in ("next_NLR", "ahead_NLR"):
        ranks = getattr(replayed, name)
        if ranks is not None and len(ranks) != num_tokens:
            raise TraceError(f"the replayed forecasts cover {len(ranks)} tokens, the workload has {num_tokens}")


def simulate(work: Workload, spec: SimSpec, prior_LE: np.ndarray | None = None,
             progress: Progress | None = None, replayed: Forecasts | None = None) -> SimResult:
    """Replay `work` through the policy and capacity of `spec` (forecast "predictor": `replayed`)."""
    check_spec(spec, work.header, prior_LE)
    check_replayed(spec, replayed, len(work.ids_NLK))
    policy, drive = make_policy(spec.policy, seed=spec.seed), drive_of(spec.policy)
    h = work.header
    ids = work.ids_NLK.astype(np.int64)
    ids[ids == MISSING] = h.num_experts  # the sink column: never cached, never counted
    forecast = SimForecast(spec.forecast, work, ids, prior_LE, replayed, spec.horizon)
    next_use = work.next_use_NLK() if drive.offline else None
    start = time.perf_counter()
    if spec.scope == "layer":
        capacity = spec.per_layer if spec.per_layer is not None else spec.capacity
        hybrid = (spec.device_tokens or np.iinfo(np.int64).max) if spec.execution == "hybrid" else None
        out = _replay_layers(work, policy, drive, capacity, ids, forecast, next_use, prior_LE, progress, spec.warm,
                             spec.prefetch, hybrid, spec.admit, spec.hybrid_prefill == "ping-pong")
    else:
        out = _replay_global(work, policy, drive, spec.capacity, ids, forecast, next_use, prior_LE, progress, spec.warm)
    return SimResult(spec, *out, step_phase=work.step_phase, step_tokens=np.diff(work.step_ptr),
                     wall_s=time.perf_counter() - start)


class _State:
    """The cache and its statistics, `[L, E+1]` (column E is the sink for MISSING ids)."""

    def __init__(self, work: Workload, prior_LE: np.ndarray | None, crf: bool = False):
        num_layers, e = work.header.num_layers, work.header.num_experts
        self.cached = np.zeros((num_layers, e + 1), bool)
        self.req = np.zeros((num_layers, e + 1), bool)
        self.stats = AccessStats.zeros((num_layers, e + 1))
        if prior_LE is not None:
            self.stats.prior[:, :e] = prior_LE
        self.rows_L1 = np.arange(num_layers)[:, None]
        self.e = e
        self.crf = crf
        """Keep the CRF (the policy ranks by it)."""
        s = work.num_steps
        self.requested = np.zeros((s, num_layers), np.int32)
        self.hits = np.zeros((s, num_layers), np.int32)
        self.demand = np.zeros((s, num_layers), np.int32)
        self.prefetch = np.zeros((s, num_layers), np.int32)
        self.prefetch_used = np.zeros((s, num_layers), np.int32)
        self.cpu = np.zeros((s, num_layers), np.int32)
        self.ahead = np.zeros((num_layers, e + 1), bool)
        """Experts loaded ahead for the current step (counted used when the step requests them)."""

    def request(self, step: int, ids_nLK: np.ndarray, next_nLK: np.ndarray | None, touch: bool = True) -> np.ndarray:
        """Marks this step's requests (and, with `touch`, updates every layer's statistics); the request mask."""
        req = self.req
        req[:] = False
        req[self.rows_L1[None], ids_nLK] = True
        req[:, self.e] = False
        if next_nLK is not None:
            self.next = np.full(req.shape, 0, np.int64)
            self.next[self.rows_L1[None], ids_nLK] = next_nLK
        if touch:
            self.stats.touch(req, step, self.crf)
            if next_nLK is not None:
                self.stats.next_use[req] = self.next[req]
        return req

    def touch_layer(self, step: int, layer: int, has_next: bool) -> None:
        """One layer's statistics, updated when that layer runs (global scope: earlier layers see old ones)."""
        req = self.req[layer]
        self.stats.touch((layer, req), step, self.crf)
        if has_next:
            self.stats.next_use[layer][req] = self.next[layer][req]

    def used_ahead(self, step: int, req: np.ndarray) -> None:
        """The step's requests judge what was loaded ahead for it: those requested were used, the rest wasted."""
        if self.ahead.any():
            self.prefetch_used[step] = (self.ahead & req).sum(1)
            self.ahead[:] = False

    def outputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.requested, self.hits, self.demand, self.prefetch, self.prefetch_used, self.cpu


def _preload(state: _State, drive: Drive, cap_L: np.ndarray, warm: bool) -> None:
    if warm and not drive.preload:
        state.cached[:, : state.e] = np.arange(state.e)[None, :] < cap_L[:, None]
    if drive.preload:
        order = np.argsort(-state.stats.prior[:, : state.e], axis=1, kind="stable")
        keep = np.arange(state.e)[None, :] < cap_L[:, None]
        state.cached[np.broadcast_to(state.rows_L1, order.shape)[keep], order[keep]] = True


def _evict_layers(state: _State, policy: Ranked, step: int, count_L: np.ndarray, protect: np.ndarray) -> None:
    """Evict up to `count_L` lowest-priority cached, unprotected experts in each layer."""
    candidates = state.cached & ~protect
    prio = np.where(candidates, policy.priority(state.stats, step), np.inf)
    order = np.argsort(prio, axis=1, kind="stable")
    take = np.minimum(count_L, candidates.sum(1))
    chosen = np.arange(prio.shape[1])[None, :] < take[:, None]
    state.cached[np.broadcast_to(state.rows_L1, order.shape)[chosen], order[chosen]] = False


def _admit(state: _State, policy: Ranked, step: int, want: np.ndarray, protect: np.ndarray, cap_L: np.ndarray
           ) -> np.ndarray:
    """`want` into the per-layer caches: room made by evicting unprotected experts, then the first that fit (in
    ascending id) cached, the rest left out (a demand miss streams through uncached). Returns what was cached."""
    over = state.cached.sum(1) + want.sum(1) - cap_L
    if over.max() > 0:
        _evict_layers(state, policy, step, over, protect)
    room = cap_L - state.cached.sum(1)
    want = want & (np.cumsum(want, axis=1) <= room[:, None])
    state.cached |= want
    return want


def _prefetch_layers(state: _State, policy: Ranked, step: int, ahead_LR: np.ndarray, cap_L: np.ndarray) -> np.ndarray:
    """PLEC's layer-order prefetch with per-layer caches: load each layer's forecast experts that are not cached,
    evicting the lowest-priority experts outside the forecast; the forecast experts are protected. Returns the
    loads per layer."""
    want = np.zeros_like(state.cached)
    valid = ahead_LR >= 0
    want[np.broadcast_to(state.rows_L1, ahead_LR.shape)[valid], ahead_LR[valid]] = True
    want[:, state.e] = False
    load = want & ~state.cached
    if load.any():
        over = state.cached.sum(1) + load.sum(1) - cap_L
        if over.max() > 0:
            _evict_layers(state, policy, step, over, want)
        room = cap_L - state.cached.sum(1)
        load &= np.cumsum(load, axis=1) <= room[:, None]
        state.cached |= load
        state.ahead |= load
    return load.sum(1)


def _initial_cache(state: _State, policy: Ranked, step: int, acts: np.ndarray, cap_L: np.ndarray) -> np.ndarray:
    """SMoE's initial decode cache: each layer's `cap_L` experts most activated in `acts` (ties: the lower id) loaded
    ahead where not cached, evicting by the policy outside them (as `--hybrid-admit`'s copies are: the engine's
    `HybridExecutor.initial_cache`). Returns the loads per layer."""
    order = np.argsort(-acts[:, : state.e], axis=1, kind="stable")
    want = np.zeros_like(state.cached)
    top = np.arange(state.e)[None, :] < np.minimum(cap_L, (acts[:, : state.e] > 0).sum(1))[:, None]
    want[np.broadcast_to(state.rows_L1, order.shape)[top], order[top]] = True
    return _admit(state, policy, step, want & ~state.cached, want, cap_L).sum(1)


def _replay_layers(work: Workload, policy: Ranked, drive: Drive, capacity: int | tuple[int, ...], ids: np.ndarray,
                   forecast: SimForecast, next_use: np.ndarray | None, prior_LE: np.ndarray | None,
                   progress: Progress | None, warm: bool = False, prefetch: int = 0, hybrid: int | None = None,
                   admit: int = 0, pingpong: bool = False):
    """`hybrid`: the fewest tokens that send a missing expert to the device (None: gpu execution); `admit`: the
    experts computed on the CPU are then loaded into the cache in the background (counted as loads ahead);
    `pingpong`: hybrid's ping-pong prefill and initial decode cache (SimSpec.hybrid_prefill)."""
    state = _State(work, prior_LE, policy.uses_crf)
    cap_L = np.broadcast_to(np.asarray(capacity), (work.header.num_layers,)).copy()
    _preload(state, drive, cap_L, warm)
    ptr, tokens, admits = work.step_ptr, work.step_tokens, drive.admits_on_miss
    wants_prob = forecast.kind != "none"
    pingpong = pingpong and hybrid is not None
    acts = np.zeros(state.cached.shape, np.int64)  # tokens routed per (layer, expert) in the prefill steps since
    for s in range(work.num_steps):                # the last decode step (ping-pong)
        prefilling = pingpong and work.step_phase[s] == PREFILL
        if pingpong and not prefilling and acts.any():
            state.prefetch[s] += _initial_cache(state, policy, s, acts, cap_L)
            acts[:] = 0
        if prefetch:  # before the step's layers run: ranked by the previous step's forecasts
            state.prefetch[s] += _prefetch_layers(state, policy, s, forecast.ahead(s, prefetch), cap_L)
        toks = tokens[ptr[s]:ptr[s + 1]]
        req = state.request(s, ids[toks], None if next_use is None else next_use[toks])
        hit = req & state.cached
        state.requested[s] = req.sum(1)
        state.hits[s] = hit.sum(1)
        state.used_ahead(s, req)
        if wants_prob:
            state.stats.prob = forecast.prob(s)
        if admits:
            miss = req & ~hit
            if hybrid is not None:  # the light misses compute on the CPU: never loaded, never admitted
                counts = np.zeros(req.shape, np.int64)
                np.add.at(counts, (state.rows_L1[None], ids[toks]), 1)
                light = miss & (counts < hybrid)
                state.cpu[s] = light.sum(1)
                miss &= ~light
                if prefilling:
                    acts += counts
            state.demand[s] = miss.sum(1)  # every miss placed on the device is loaded, cached or streamed through
            if not prefilling:  # (a ping-pong prefill's pass through the stream rows, uncached)
                _admit(state, policy, s, miss, req, cap_L)
            if hybrid is not None and admit and light.any():  # then the CPU's, in the background, as room allows
                light &= np.cumsum(light, axis=1) <= admit
                state.prefetch[s] += _admit(state, policy, s, light, req & ~light, cap_L).sum(1)
        else:
            load = np.zeros_like(req)
            load[:, : state.e] = policy.admissions(forecast.ranked(s), state.cached[:, : state.e])
            over = state.cached.sum(1) + load.sum(1) - cap_L
            if over.max() > 0:
                _evict_layers(state, policy, s, over, load)
            state.cached |= load
            state.ahead |= load
            state.prefetch[s] = load.sum(1)
        if progress is not None and s % 4096 == 0:
            progress(s)
    return state.outputs()


def _replay_global(work: Workload, policy: Ranked, drive: Drive, capacity: int, ids: np.ndarray, forecast: SimForecast,
                   next_use: np.ndarray | None, prior_LE: np.ndarray | None, progress: Progress | None,
                   warm: bool = False):
    state = _State(work, prior_LE, policy.uses_crf)
    if drive.preload:
        flat = np.argsort(-state.stats.prior[:, : state.e].ravel(), kind="stable")[:capacity]
        state.cached[flat // state.e, flat % state.e] = True
    elif warm:  # the engine's warm order: expert 0 of every layer, then expert 1, ...
        order = np.arange(state.e * len(state.cached))[:capacity]
        state.cached[order % len(state.cached), order // len(state.cached)] = True
    ptr, tokens = work.step_ptr, work.step_tokens
    stats, cached = state.stats, state.cached
    occupancy = int(cached.sum())
    for s in range(work.num_steps):
        toks = tokens[ptr[s]:ptr[s + 1]]
        req = state.request(s, ids[toks], None if next_use is None else next_use[toks], touch=False)
        if forecast.kind != "none":
            stats.prob = forecast.prob(s)
        prio = policy.priority(stats, s).astype(np.float64)  # elementwise: rows are refreshed one by one
        masked = np.where(cached, prio, np.inf)
        for layer in range(len(req)):
            state.touch_layer(s, layer, next_use is not None)
            prio[layer] = policy.priority(stats.take(layer), s)
            want = np.flatnonzero(req[layer])
            hit = cached[layer, want]
            state.requested[s, layer], state.hits[s, layer] = len(want), int(hit.sum())
            masked[layer] = np.where(cached[layer] & ~req[layer], prio[layer], np.inf)  # in use: protected
            misses = want[~hit]
            state.demand[s, layer] = len(misses)  # every miss is loaded, cached or streamed through
            for expert in misses:
                if occupancy >= capacity:
                    i = int(np.argmin(masked))
                    if masked.flat[i] == np.inf:
                        break  # everything cached is in use: stream the rest through
                    cached.flat[i], masked.flat[i] = False, np.inf
                    occupancy -= 1
                cached[layer, expert] = True
                occupancy += 1
            masked[layer] = np.where(cached[layer], prio[layer], np.inf)
        if progress is not None and s % 1024 == 0:
            progress(s)
    return state.outputs()
