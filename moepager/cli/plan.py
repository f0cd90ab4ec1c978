"""`moepager plan TRACE --expert-memory 25%`: MoEpic's per-layer budgets and split ratios for a routing trace, and
what they move against the even split (planning/configurator.py).

The hit curves are measured on the `--fit` requests; the configured split is then judged on the `--requests`
ones (disjoint by default: the first 70% and the rest) by replaying them through per-layer LRU caches of the
chosen sizes: a hit on a cached top still loads its bottom (1 - θ of an expert), a miss loads the whole expert.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from moepager.atomic_io import atomic_file, check_file
from moepager.checkpoints.split import PARTS
from moepager.config import Budget
from moepager.planning.configurator import Plan, layer_costs, statistics, vram_allocation
from moepager.planning.cost import PROFILES, CostModel
from moepager.predictors import FITTED, make_predictor
from moepager.store.budget import format_bytes
from moepager.trace.format import TraceError, TraceReader
from moepager.trace.predict import forecast_ranks
from moepager.trace.simulate import SimSpec, check_spec, simulate
from moepager.trace.split import simulate_split
from moepager.trace.workload import Workload, chosen_requests, load_workload, parse_requests

HELP = "per-layer expert budgets and split ratios for a trace (MoEpic's configurator), judged against the even split"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file (moepager trace convert ... or generate --record-trace)")
    p.add_argument("--expert-memory", required=True, help="the budget to split: a size (4GiB) or a share (25%%)")
    p.add_argument("--profile", default="cpu-disk",
                   help=f"costs: one of {sorted(PROFILES)} or a `moepager calibrate` JSON (default cpu-disk)")
    p.add_argument("--zeta", type=float, default=0.01, help="budget moved per step, as a share of it (default 0.01)")
    p.add_argument("--fit", help="requests A:B the hit curves are measured on (default: the first 70%%)")
    p.add_argument("--requests", help="requests A:B the plan is judged on (default: the rest)")
    p.add_argument("--expert-bytes", type=int, help="bytes per expert when the trace header has none")
    p.add_argument("--predictor", choices=FITTED,
                   help="a fitted predictor whose forecasts prefetch each layer's experts (MoEpic's prefetch term: "
                        "the bottoms of cached tops and whole experts, within the compute window)")
    p.add_argument("--predictor-file", help="--predictor: the file `moepager predictor fit` wrote")
    p.add_argument("--prefetch-distance", type=int, default=1, metavar="D",
                   help="--predictor: forecasts made D MoE layers ahead (default 1)")
    p.add_argument("--dense-bytes-per-layer", type=int, default=0, metavar="BYTES",
                   help="--predictor: a MoE layer's non-expert weights (attention, router, shared experts), read in "
                        "the window its prefetch fills (MoEpic's T_att; default: the profile's shared experts only)")
    p.add_argument("--head-bytes", type=int, default=0, metavar="BYTES",
                   help="--predictor: the weights read between a token's last MoE layer and the next token's first "
                        "(LM head, dense layers: MoEpic's T_head, the first layer's window; default 0)")
    p.add_argument("--whole-experts", action="store_true",
                   help="no split (θ = 1 in every layer): per-layer budgets of whole experts, what the engine's "
                        "--layer-plan takes")
    p.add_argument("--parts", type=int, choices=PARTS,
                   help="split ratios in steps of 1/PARTS, what a `moepager split --parts PARTS` checkpoint runs "
                        "(default: any ratio)")
    p.add_argument("--theta", type=float, metavar="θ",
                   help="every layer split at this ratio (0 < θ <= 1) instead of the configurator's choice")
    p.add_argument("--json", metavar="PATH", help="write the plan and the comparison as JSON")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")


def run(args: argparse.Namespace) -> int:
    json_out = check_file(args.json, "--json", args.force, {"TRACE": args.trace, "--profile": args.profile})
    with TraceReader(args.trace) as reader:
        count, header = len(reader), reader.header
    split = max(1, min(count - 1, round(0.7 * count))) if count > 1 else count
    fit = parse_requests(args.fit) if args.fit else slice(0, split)
    judged = parse_requests(args.requests) if args.requests else slice(split if count > 1 else 0, None)
    if args.expert_bytes is not None and args.expert_bytes < 1:
        raise TraceError(f"--expert-bytes must be >= 1, got {args.expert_bytes}")
    expert_bytes = args.expert_bytes or header.expert_bytes
    if not expert_bytes:
        raise TraceError(f"{args.trace} does not say how large an expert is: give --expert-bytes")
    num_layers, num_experts, k = header.num_layers, header.num_experts, header.top_k
    budget = Budget.parse(args.expert_memory, "--expert-memory")
    total = budget.fraction * num_layers * num_experts if budget.fraction is not None else budget.nbytes / expert_bytes
    try:
        cost = CostModel.profile(args.profile, expert_bytes)
    except ValueError as e:
        raise TraceError(str(e)) from None
    if args.dense_bytes_per_layer < 0 or args.head_bytes < 0:
        raise TraceError("--dense-bytes-per-layer and --head-bytes are sizes in bytes, >= 0")
    costs = layer_costs(cost, num_layers, args.dense_bytes_per_layer, args.head_bytes)
    if (args.predictor is None) != (args.predictor_file is None):
        raise TraceError("--predictor and --predictor-file go together")
    fitted = load_workload(args.trace, "decode", 1, fit)
    ranks = forecasts(args, fitted, fit) if args.predictor else None
    hit_LC, prediction = statistics(fitted.ids_NLK[fitted.step_tokens], ranks, num_experts)
    split = not args.whole_experts
    if args.theta is not None and not split:
        raise TraceError("--theta is a split ratio, and --whole-experts splits nothing: drop one of them")
    if args.theta is not None and not 0 < args.theta <= 1:
        raise TraceError(f"--theta is a split ratio in (0, 1], got {args.theta}")
    if args.theta is not None and args.parts is not None and abs(args.theta * args.parts - round(args.theta *
                                                                                               args.parts)) > 1e-9:
        raise TraceError(f"--theta {args.theta} is not a multiple of 1/{args.parts}")
    plan = vram_allocation(total, hit_LC, k, costs, args.zeta, prediction, split=split, parts=args.parts,
                           theta=args.theta)
    test = load_workload(args.trace, "decode", 1, judged)
    rows = [judge("even split, whole experts", np.full(num_layers, np.floor(total / num_layers)),
                  np.ones(num_layers), test, expert_bytes),
            judge("configured (MoEpic)" + ("" if split else ", whole experts") +
                  (f", θ = {args.theta}" if args.theta else ""), np.floor(plan.cached_L), plan.theta_L,
                  test, expert_bytes, args.parts, plan.budgets_L)]
    print(f"{args.trace}: {num_layers} layers x {num_experts} experts (top-{k}), budget {args.expert_memory} = "
          f"{total:.1f} experts ({format_bytes(total * expert_bytes)}); hit curves from {len(fitted.names)} "
          f"requests, judged on {len(test.names)}; profile {args.profile}"
          + (f"; prefetch from {args.predictor} forecasts {args.prefetch_distance} layer(s) ahead (windows: T_att "
             f"{1e3 * costs.attention_s:.3f} ms a layer, T_head {1e3 * costs.head_s:.3f} ms, an expert's load "
             f"{1e3 * costs.load_s:.3f} ms)" if ranks is not None else "; no prefetch"))
    print(layer_table(plan))
    even_s = plan.objectives[0]  # the budget exchange starts from the even split
    print(f"modeled exposed load per token: {1e3 * plan.exposed_s:.2f} ms configured, {1e3 * even_s:.2f} ms even "
          f"({len(plan.objectives) - 1} budget moves)")
    for row in rows:
        print(f"{row['label']:<26} hit {100 * row['hit_rate']:.1f}%, {row['bytes_per_token'] / 2**20:.1f} MiB a token")
    ratio = rows[1]["bytes_per_token"] / rows[0]["bytes_per_token"]
    print(f"configured / even: {ratio:.3f}x the bytes a token")
    if json_out is not None:
        with atomic_file(json_out) as tmp:
            tmp.write_text(json.dumps({"trace": args.trace, "budget_experts": total, "profile": args.profile,
                                       "whole_experts": not split,
                                       "budgets": plan.budgets_L.tolist(), "theta": plan.theta_L.tolist(),
                                       "cached": plan.cached_L.tolist(), "exposed_s": plan.exposed_s,
                                       "even_exposed_s": even_s, "judged": rows}, indent=1))
    return 0


def forecasts(args: argparse.Namespace, work: Workload, fit: slice) -> np.ndarray:
    """The predictor's ranked forecasts for every step of the fit requests, every expert ranked ([S, L, E])."""
    h = work.header
    predictor = make_predictor(args.predictor, num_layers=h.num_layers, num_experts=h.num_experts,
                               file=args.predictor_file, distance=args.prefetch_distance)
    with TraceReader(args.trace) as reader:
        chosen = chosen_requests(fit, len(reader), args.trace)
        ranks = forecast_ranks(predictor, reader, chosen, args.prefetch_distance, h.num_experts)
    return ranks[work.step_tokens]


def judge(label: str, cached_L: np.ndarray, theta_L: np.ndarray, work: Workload, expert_bytes: int,
          parts: int | None = None, budgets_L: np.ndarray | None = None) -> dict:
    """Per-layer LRU caches of `cached_L` experts' tops (θ_L of each) replayed over `work`: hit rate and bytes a
    token (a hit loads the bottom, a miss the whole expert). With `parts` (θ_L multiples of 1/parts), what a split
    checkpoint's run does instead (trace/split.py): each layer caches floor(budget·parts) parts of its experts' tops
    and loads every bottom part; the hit rate is then the share of parts found cached."""
    header = work.header
    if parts is not None and budgets_L is not None:
        tops = [max(1, round(t * parts)) for t in theta_L]
        capacities = tuple(int(min(header.num_experts * t, max(header.top_k * t, np.floor(v * parts + 1e-9))))
                           for v, t in zip(budgets_L, tops))
        spec = SimSpec("lru", max(capacities), per_layer=capacities)
        result = simulate_split(work, spec, parts, tops)
        moved = float(result.demand_loads_SL.sum()) * expert_bytes / parts
        tokens = int(result.step_tokens.sum())
        return {"label": label, "hit_rate": result.hit_rate(), "bytes_per_token": moved / max(tokens, 1),
                "capacities": list(capacities), "theta": [t / parts for t in tops]}
    capacities = tuple(int(min(max(c, header.top_k), header.num_experts)) for c in cached_L)
    spec = SimSpec("lru", max(capacities), per_layer=capacities)
    check_spec(spec, header, None)
    result = simulate(work, spec)
    hits_L, misses_L = result.hits_SL.sum(0), (result.requested_SL - result.hits_SL).sum(0)
    moved = float((misses_L + hits_L * (1 - theta_L)).sum() * expert_bytes)
    tokens = int(result.step_tokens.sum())
    return {"label": label, "hit_rate": result.hit_rate(), "bytes_per_token": moved / max(tokens, 1),
            "capacities": list(capacities), "theta": [float(t) for t in theta_L]}


def layer_table(plan: Plan) -> str:
    lines = ["layer  budget (experts)  theta  tops cached  resident of top-k  exposed ms"]
    for i, (v, t, c, m, e) in enumerate(zip(plan.budgets_L, plan.theta_L, plan.cached_L, plan.resident_L,
                                            plan.exposed_L)):
        lines.append(f"{i:>5}  {v:>16.2f}  {t:>5.2f}  {int(c):>11}  {m:>17.2f}  {1e3 * e:>10.3f}")
    return "\n".join(lines)
