"""Prefetch in the engine: a predictor's forecasts become a priority queue of expert loads.

Algorithm (per forward pass; the Prefetcher is a RoutingObserver plus the generation loop's pass hook):
1. begin_pass: the pass's tokens give each row's semantic embedding; the predictor starts an iteration, and
   forecasts for the first `distance` layers (made before any layer runs: fMoE's semantic search) are queued. In a
   routing replay the tokens are the trace's (what the recorded model read), not the replayed model's own.
2. each MoE layer i routes: the store settles layer i's prefetches (cancel what is still queued and unneeded,
   promote what is queued and needed to an on-demand load, mark loaded-but-unneeded experts stale); queued
   requests for layer i are dropped (too late); the predictor observes the layer and forecasts the target
   `distance` layers ahead (wrapping into the next token); the forecast's rows are selected (top-k, or fMoE's
   similarity rule; with `min_p`, only experts at least that likely) and merged into the queue; the eviction
   policy sees the target layer's mean forecast (fMoE's eviction ranks by p * freq); a policy that ranks by
   predicted next use (PLEC) also sees layer i's forecast for the next token, made once layer i has routed.
3. the queue is pumped: highest priority first, priority = probability mass / layers until needed (fMoE's
   p / (l - l_now)), at most `max_inflight` prefetches loading at once, at most a layer's cache quota per
   target layer, on the transfer engine's prefetch lane while the model keeps computing.
Misses are always loaded on demand by the store, so outputs are those of the all-resident model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Protocol

import torch

from moepager.config import PrefetchConfig
from moepager.errors import MoepagerError
from moepager.models.layers import CausalLM
from moepager.models.moe import MoEBlock
from moepager.policies.base import ForecastConsumer
from moepager.policies.prefetch import PrefetchAware
from moepager.predictors import (
    PREDICTORS,
    Forecast,
    LayerObservation,
    Predictor,
    RecordedRouting,
    bind_replay,
    default_distance,
    make_predictor,
    target_of,
    token_keys,
)
from moepager.predictors.expert_map import hashed_tokens
from moepager.store.view import Priority, StoreView
from moepager.types import PassInfo, Phase, RoutingDecision

FLEX_PASSES = 32
"""SMoE-Flex: the forward passes whose forecasts are judged before the least accurate half of the layers stop
prefetching (the paper ranks layers by its predictor's accuracy without saying over what; here, this engine's first
passes, online)."""

NO_SCORES = torch.empty(0, 0)
"""The observation's scores for predictors that do not read them (they stay on the device, uncopied)."""


class ReplaySource(RecordedRouting, Protocol):
    """A routing replay as the prefetcher sees it (runtime/replay.py's RouteReplayer)."""

    def recorded_tokens(self) -> Sequence[str] | Sequence[int] | None:
        """The trace's tokens at this pass's rows; None where they were not recorded."""
        ...

    def recorded_token(self, request: int, position: int) -> str | int | None:
        """The trace's token of one request at one position; None where it was not recorded."""
        ...


class SemanticEmbed(Protocol):
    """token ids_N -> per-token vectors_ND whose running mean over a request is its semantic embedding (the
    model's embedding layer, or expert_map.hashed_tokens for stores fitted on traces). `recorded`: in a replay, the
    trace's tokens at those rows (hashed tokens hash them, as the fit did; the model's embedding reads its own ids)."""

    def __call__(self, ids_N: torch.Tensor, recorded: Sequence[str] | Sequence[int] | None = None) -> torch.Tensor:
        ...


@dataclass(frozen=True)
class PrefetchPlan:
    distance: int
    """MoE layers between the layer a forecast is made after and its target."""
    per_row: int
    """Experts per forecast row (the floor of fMoE's similarity rule); 0: none (forecasts only rank evictions)."""
    max_inflight: int
    """Prefetches loading at the same time, at most."""
    min_p: float = 0.0
    """A selected expert is prefetched only when its forecast probability is at least this."""
    fixed: bool = False
    """SMoE's Fixed-N: a row selects down its ranking until `per_row` of the experts it names are not cached at the
    target (those cached before them are named too, so the store keeps them); off: its top `per_row` (Adaptive-N:
    the store loads those not cached)."""
    flex: bool = False
    """SMoE-Flex: once FLEX_PASSES passes are judged, the least accurate half of the MoE positions prefetch nothing."""


@dataclass
class InlineCost:
    """What the prefetcher costs the forward thread (a run's statistics section "prefetch"): its work in the pass hook
    and the routing observer (the predictor's observe and forecast, fMoE's map matching, queueing and issuing loads),
    which the forward waits for, per phase. fMoE decouples its matcher onto threads of its own (§2.9); here it runs on
    the forward thread, and this says what that costs."""

    predictor: str
    seconds: dict[Phase, float]
    passes: dict[Phase, int]
    decode_s: float = 0.0
    """The run's decode time, to put the decode cost in proportion (set when the run ends)."""

    def rows(self) -> list[tuple[str, str]]:
        decode, prefill = self.seconds["decode"], self.seconds["prefill"]
        share = f", {100 * decode / self.decode_s:.1f}% of the decode time" if self.decode_s else ""
        per_pass = 1e3 * decode / max(self.passes["decode"], 1)
        return [(f"prefetcher ({self.predictor}) on the forward thread",
                 f"{per_pass:.3f} ms a decode pass{share}; {1e3 * prefill:.1f} ms in prefill")]

    def to_dict(self) -> dict[str, Any]:
        return {"predictor": self.predictor, "inline_s": dict(self.seconds), "passes": dict(self.passes),
                "inline_ms_per_decode_pass": 1e3 * self.seconds["decode"] / max(self.passes["decode"], 1),
                "decode_share": self.seconds["decode"] / self.decode_s if self.decode_s else None}


class Prefetcher:
    def __init__(self, predictor: Predictor, store: StoreView, moe_layers: Sequence[int],
                 plan: PrefetchPlan, embed: SemanticEmbed | None = None, forecasts: ForecastConsumer | None = None,
                 next_use: bool = False, stateful: bool = False, priority: Priority = PrefetchAware.priority):
        self.predictor, self.store, self.plan = predictor, store, plan
        self.moe_layers = list(moe_layers)
        self.position = {layer: i for i, layer in enumerate(moe_layers)}
        self.targets = [target_of(i, plan.distance, len(moe_layers)) for i in range(len(moe_layers))]
        """(target, ahead) of the forecast made after each MoE position (target_of refuses a distance outside
        1..L)."""
        self.quota = [store.quota(layer) for layer in moe_layers]
        """Each MoE position's cache quota: at most that many prefetches are queued for it."""
        self.embed = embed
        """None when the predictor uses no semantic embedding."""
        self.forecasts = forecasts
        """Sees every target layer's mean forecast (an eviction policy that ranks by them: fMoE, PLEC)."""
        self.next_use = forecasts is not None and next_use
        """The policy also wants, once a layer has routed, the forecast of that layer at the next token (PLEC)."""
        self.stateful = stateful
        """The predictor keeps per-request state (the path predictor's): it is told the rows' requests."""
        self.priority = priority
        """A queued prefetch's rank from its probability mass and the MoE layers until it is needed (the store's
        prefetch policy's)."""
        self._staged: tuple[Forecast | None, Forecast | None] = (None, None)
        """A predictor on the device: the forecasts `stage` made (next-token use, prefetch target), read in `routed`."""
        self.pending: dict[tuple[int, int], dict[int, float]] = {}
        """(iteration, MoE position) -> expert -> probability mass, for targets not yet routed."""
        self.iteration = 0
        self.now = -1
        self._sem_sum: dict[int, tuple[torch.Tensor, int]] = {}
        self._last_rows: list[int] = []
        self.replay: ReplaySource | None = None
        """The routing replay running, if any (`bind_replay`): its recorded tokens are what the predictor reads."""
        self.picked: dict[tuple[int, int], set[int]] = {}
        """SMoE-Flex, while it judges: (iteration, MoE position) -> the experts the forecasts picked (their top
        `per_row`), set against the routing when the position routes."""
        self.judged = [[0, 0] for _ in moe_layers]
        """SMoE-Flex: per MoE position, routed experts the forecasts had picked, and routed experts."""
        self.passes = 0
        self.flex_off: frozenset[int] = frozenset()
        """SMoE-Flex: the MoE positions that prefetch nothing (chosen once FLEX_PASSES passes are judged)."""
        self.flex_judging = plan.flex
        """SMoE-Flex: the forecasts are still being judged (the positions not yet chosen)."""
        self.on_forecast: Callable[[int, int, torch.Tensor], None] | None = None
        """Told of every forecast that prefetches (pass id, MoE layer, probabilities per row): `--configure auto`'s
        prediction statistics (runtime/configure.py)."""
        self.reset_cost()
        self._phase: Phase = "prefill"

    def reset_cost(self) -> None:
        """Start the forward-thread accounting again (each generate call's statistics are its own)."""
        name = getattr(self.predictor, "name", type(self.predictor).__name__)
        self.cost = InlineCost(name, {"prefill": 0.0, "decode": 0.0}, {"prefill": 0, "decode": 0})

    def bind_replay(self, source: ReplaySource | None) -> None:
        """For the length of a replay (None ends it): the predictor reads the trace's tokens instead of the
        model's (a replayed model's tokens are not the recorded model's; a predictor fitted on the trace keys on
        the recorded ones), and a replay-only predictor reads the recorded routing."""
        self.replay = source
        bind_replay(self.predictor, source)

    @property
    def lookahead(self) -> Callable[[int, int, int], torch.Tensor | None] | None:
        """The predictor's forecast of a decoding request's next token from that token, before its pass (the path
        predictor's `lookahead`; None for a predictor without one): what the token scheduler groups by."""
        return self._lookahead if hasattr(self.predictor, "lookahead") else None

    def _lookahead(self, request: int, start: int, token_id: int) -> torch.Tensor | None:
        if self.replay is not None:  # the pass will hand the predictor the trace's token there, not the model's
            recorded = self.replay.recorded_token(request, start)
            if recorded is not None:
                token_id = int(token_keys([recorded])[0])  # type: ignore[list-item]
        return self.predictor.lookahead(request, start, token_id)  # type: ignore[attr-defined]

    # -- pass hook --------------------------------------------------------------------------------------------
    def begin_pass(self, info: PassInfo) -> None:
        start = time.perf_counter()  # (timed inline, not in a wrapper: the overhead guard counts calls)
        self._phase = info.phase
        self.cost.passes[info.phase] += 1
        self.iteration = info.pass_id + 1
        self.now = -1
        self.pending = {key: v for key, v in self.pending.items() if key[0] >= self.iteration}
        if self.flex_judging:
            self.passes += 1
            self.picked = {key: v for key, v in self.picked.items() if key[0] >= self.iteration}
            if self.passes > FLEX_PASSES:
                self.choose_flex()
        ids_N = info.token_ids_N
        recorded = self.replay.recorded_tokens() if self.replay is not None else None
        sem_ND = self._semantic(info, ids_N, recorded) if self.embed is not None and len(ids_N) else None
        self._last_rows = (torch.cumsum(torch.tensor(info.counts), 0) - 1).tolist()
        if self.stateful:
            self.predictor.begin_rows(info.requests, info.starts, info.counts, info.row_phases)
        self.predictor.start_iteration(ids_N if recorded is None else token_keys(recorded), sem_ND)
        for j in range(min(self.plan.distance, len(self.moe_layers))):
            self._enqueue(self.predictor.forecast(j, 0), j, 0)
        self._pump()
        self.cost.seconds[info.phase] += time.perf_counter() - start

    def _semantic(self, info: PassInfo, ids_N: torch.Tensor, recorded: Sequence[str] | Sequence[int] | None
                  ) -> torch.Tensor:
        """Each token row's request embedding so far: running means carried across passes per request (started
        again when a request computes from its first token: new, or preempted). Hashed tokens hash the recorded
        tokens in a replay (what a store fitted on the trace hashed), the model's embedding its own ids."""
        assert self.embed is not None
        with torch.no_grad():
            vec_ND = self.embed(ids_N, recorded).float()  # on the host (both embeddings are)
        out, offset = [], 0
        for request, start, n in zip(info.requests, info.starts, info.counts, strict=True):
            total, count = self._sem_sum.get(request, (torch.zeros(vec_ND.shape[1]), 0)) if start else (
                torch.zeros(vec_ND.shape[1]), 0)
            sums = total + torch.cumsum(vec_ND[offset:offset + n], 0)
            out.append(sums / (count + torch.arange(1, n + 1)[:, None]))
            self._sem_sum[request] = (sums[-1], count + n)
            offset += n
        return torch.cat(out)

    def end_request(self, request_id: int) -> None:
        """A request finished: forget its semantic sum (and the predictor its state)."""
        self._sem_sum.pop(request_id, None)
        if self.stateful:
            self.predictor.end_request(request_id)

    # -- routing observer -------------------------------------------------------------------------------------
    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        """What the predictor reads comes to the host with the routed ids (models/routing.py: one wait). A
        predictor on the host gets the router's scores or input from there; one that runs where the hidden states
        live (`hidden` "device": gate lookahead) observes and forecasts here, before anything is read, and only
        its forecasts are copied."""
        start = time.perf_counter()
        predictor = self.predictor
        staged = [route.scores_TE.float()] if predictor.needs_scores else []
        if predictor.hidden == "host":
            staged.append(x_ND.detach())
        elif predictor.hidden == "device":
            i = self.position[layer]
            predictor.observe(i, LayerObservation(staged[0] if staged else NO_SCORES, route.ids_TK, x_ND.detach()))
            self._staged = (predictor.forecast(i, 1) if self.next_use else None, predictor.forecast(*self.targets[i]))
            staged = _forecast_tensors(self._staged)
        self.cost.seconds[self._phase] += time.perf_counter() - start
        return staged

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        start = time.perf_counter()
        i = self.position[layer]
        self.now = i
        ids_NK = route.ids_host_TK  # the block's one copy off the device (the store reads it too)
        assert ids_NK is not None
        routed_ids = ids_NK.flatten().tolist()
        self.store.settle(layer, routed_ids)
        self.pending.pop((self.iteration, i), None)
        if self.flex_judging:
            self.judge(i, routed_ids)
        predictor = self.predictor
        if predictor.hidden == "device":  # observed and forecast in `stage`; `staged` holds its forecasts' copies
            after, target = _on_host(self._staged, staged)
        else:
            probs_NE = staged[0] if predictor.needs_scores else NO_SCORES
            x_seen = staged[-1] if predictor.hidden == "host" else None
            predictor.observe(i, LayerObservation(probs_NE, ids_NK, x_seen))
            after = predictor.forecast(i, 1) if self.next_use else None  # (only for a policy that ranks next use)
            target = predictor.forecast(*self.targets[i])
        if self.forecasts is not None and after is not None and len(after.probs_NE):  # PLEC: next-token use ranks
            self.forecasts.predict(layer, after.rows(self._last_rows).probs_NE.mean(0).numpy())  # layer i's experts
        self._enqueue(target, *self.targets[i])
        self._pump()
        self.cost.seconds[self._phase] += time.perf_counter() - start

    # -- queue ------------------------------------------------------------------------------------------------
    def _enqueue(self, forecast: Forecast | None, j: int, ahead: int) -> None:
        """Merge a forecast's selected experts into the queue entry of its target (the union over rows, each
        expert weighted by its summed probability). Next-iteration targets use each request's last row."""
        if forecast is None:
            return
        if ahead:
            forecast = forecast.rows(self._last_rows)
        entry = self.pending.setdefault((self.iteration + ahead, j), {})
        probs_NE = forecast.probs_NE
        if self.forecasts is not None and len(probs_NE):
            self.forecasts.predict(self.moe_layers[j], probs_NE.mean(0).numpy())
        if not self.plan.per_row or j in self.flex_off:  # forecasts rank evictions only (or Flex turned j off)
            return
        if self.on_forecast is not None:
            self.on_forecast(self.iteration + ahead - 1, self.moe_layers[j], probs_NE)
        top = forecast.chosen(self.plan.per_row) if self.flex_judging or not self.plan.fixed else []
        if self.flex_judging:
            self.picked.setdefault((self.iteration + ahead, j), set()).update(e for row in top for e, _ in row)
        floor = self.plan.min_p
        for chosen in self._fixed(forecast, j) if self.plan.fixed else top:
            for e, p in chosen:
                if p > 0 and p >= floor:  # an expert the forecast gives no chance is never loaded for it
                    entry[e] = entry.get(e, 0.0) + p

    def judge(self, i: int, routed: Sequence[int]) -> None:
        """SMoE-Flex: MoE position i routed to `routed`; count those its forecasts had picked."""
        picked = self.picked.pop((self.iteration, i), None)
        if picked is not None:
            self.judged[i][0] += sum(e in picked for e in routed)
            self.judged[i][1] += len(routed)

    def choose_flex(self) -> None:
        """SMoE-Flex: turn prefetch off at the half of the MoE positions whose forecasts were least accurate (routed
        experts picked / routed; ties: the later position), from now on."""
        accuracy = [hit / max(seen, 1) for hit, seen in self.judged]
        order = sorted(range(len(accuracy)), key=lambda i: (accuracy[i], -i))
        self.flex_off = frozenset(order[: len(order) // 2])
        self.flex_judging, self.picked = False, {}

    def _fixed(self, forecast: Forecast, j: int) -> list[list[tuple[int, float]]]:
        """SMoE's Fixed-N selection (§2.7): each row's ranking, most likely first, down to its `per_row`-th expert not
        cached at MoE position j now (or to where the forecast gives no chance). Chosen when the forecast is queued,
        so pumping the queue again loads no more."""
        cached, n = self.store.cached(self.moe_layers[j]), self.plan.per_row  # type: ignore[attr-defined]
        values_NE, order_NE = torch.sort(forecast.probs_NE, dim=1, descending=True)
        out = []
        for ids, ps in zip(order_NE.tolist(), values_NE.tolist(), strict=True):
            row, fresh = [], 0
            for e, p in zip(ids, ps, strict=True):
                if fresh == n or p <= 0:
                    break
                row.append((e, p))
                fresh += e not in cached
            out.append(row)
        return out

    def _pump(self) -> None:
        """Issue queued prefetches, best priority first, while fewer than max_inflight are loading."""
        room = self.plan.max_inflight - self.store.prefetches_in_flight()
        if room <= 0 or not self.pending:
            return
        num_layers = len(self.moe_layers)
        ranked = []
        for (iteration, j), entry in self.pending.items():
            until = (iteration - self.iteration) * num_layers + j - self.now
            if until <= 0:
                continue
            layer = self.moe_layers[j]
            most = None if self.plan.fixed else self.quota[j]  # Fixed-N's entries name the cached ones they pass
            for e, mass in sorted(entry.items(), key=itemgetter(1), reverse=True)[:most]:  # stable
                ranked.append((self.priority(mass, until), layer, e))
        ranked.sort(key=itemgetter(0), reverse=True)
        self.store.prefetch_ranked(list(map(itemgetter(1, 2), ranked)), room)


def build_prefetcher(config: PrefetchConfig, model: CausalLM, store: StoreView,
                     forecasts: ForecastConsumer | None = None, next_use: bool = False) -> Prefetcher:
    """The configured predictor, wired to the model's routers and embedding layer, to the store (and its prefetch
    policy's ranking), and to `forecasts`, the eviction policy that ranks by forecasts (fMoE, PLEC) if any."""
    assert config.predictor is not None
    cfg = model.config
    blocks = model.moe_blocks()
    routers = [_router_scores(block) for block in blocks]
    num_layers = len(blocks)
    distance = config.distance or default_distance(config.predictor, num_layers)
    predictor = make_predictor(config.predictor, num_layers=num_layers, num_experts=cfg.num_experts,
                               file=config.file, routers=routers, learn=config.learn, distance=distance)
    embed: SemanticEmbed | None = None
    if predictor.semantic == "embedding":
        embed = _embedding(model.model.embed_tokens)
    elif predictor.semantic == "hashed-tokens":
        embed = _hashed
    spec = PREDICTORS[config.predictor]
    per_row = config.per_row if config.per_row is not None else spec.default_per_row or cfg.top_k
    min_p = config.min_p if config.min_p is not None else spec.default_min_p
    if config.fixed and not callable(getattr(store, "cached", None)):
        raise MoepagerError("--prefetch-fixed walks a forecast past the experts this engine's device cache holds; "
                            "OD-MoE's workers (--workers) load experts just in time and keep no cache here to walk "
                            "past: drop --prefetch-fixed")
    for flag, on in (("--prefetch-fixed", config.fixed), ("--prefetch-flex", config.flex)):
        if on and per_row < 1:
            raise MoepagerError(f"{flag} needs experts to prefetch; --prefetch-k {per_row} loads none")
    plan = PrefetchPlan(distance, per_row, config.max_inflight or 2 * cfg.top_k, min_p, config.fixed, config.flex)
    return Prefetcher(predictor, store, [b.layer for b in blocks], plan, embed, forecasts, next_use, spec.stateful,
                      store.priority)


def router_scores(model: CausalLM) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """The model's routers in MoE-layer order, as x_ND -> scores_NE (what gate lookahead applies)."""
    return [_router_scores(block) for block in model.moe_blocks()]


def _router_scores(block: MoEBlock) -> Callable[[torch.Tensor], torch.Tensor]:
    """The router on its own device and dtype; its scores stay there (the prefetcher copies a forecast to the host
    with the layer's routed ids)."""
    gate = block.gate
    weight = next(gate.parameters())
    own = getattr(gate, "scores", None)  # the scores alone, without the top-k (every built-in router has them)

    def scores(x_ND: torch.Tensor) -> torch.Tensor:
        x_ND = x_ND.to(device=weight.device, dtype=weight.dtype)
        return own(x_ND) if own is not None else gate(x_ND).scores_TE.float()
    return scores


def _forecast_tensors(forecasts: Sequence[Forecast | None]) -> list[torch.Tensor]:
    """The tensors of some forecasts in order, a confidence after its probabilities (what `_on_host` puts back).
    Loops, not comprehensions: this runs at every observed layer (a comprehension is a Python call of its own)."""
    out: list[torch.Tensor] = []
    for f in forecasts:
        if f is not None:
            out += (f.probs_NE,) if f.confidence_N is None else (f.probs_NE, f.confidence_N)
    return out


def _on_host(forecasts: Sequence[Forecast | None], copies: Sequence[torch.Tensor]) -> list[Forecast | None]:
    """The forecasts again, their tensors replaced by `copies` (host copies of `_forecast_tensors`' list)."""
    it = iter(copies)
    out: list[Forecast | None] = []
    for f in forecasts:
        out.append(None if f is None else Forecast(next(it), None if f.confidence_N is None else next(it)))
    return out


def _embedding(table: torch.nn.Embedding) -> SemanticEmbed:
    """The token embedding looked up on the host, where a pass's token ids are: a CUDA model's table is copied to
    host memory once (vocab x hidden in the model's dtype: 420 MB for DeepSeek-V2-Lite), so no pass waits for the
    device before its first layer runs (looking it up on the device and copying it back was one sync a pass)."""
    weight = table.weight.detach()
    host = weight if weight.device.type == "cpu" else weight.to("cpu")

    def embed(ids_N: torch.Tensor, recorded: Sequence[str] | Sequence[int] | None = None) -> torch.Tensor:
        return host.index_select(0, ids_N)  # the pass's token ids are a host tensor (runtime/runner.py)
    return embed


def _hashed(ids_N: torch.Tensor, recorded: Sequence[str] | Sequence[int] | None = None) -> torch.Tensor:
    return hashed_tokens(ids_N.tolist() if recorded is None else recorded)
