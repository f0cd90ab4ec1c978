"""`moepager simulate TRACE`: replay a routing trace against cache policies and sizes; table, JSON and plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moepager.planning.cost import PROFILES, CostModel
from moepager.policies import POLICIES
from moepager.store.budget import Budget
from moepager.trace.format import TraceError, TraceReader
from moepager.trace.report import format_table, plot_hit_rates, summary
from moepager.trace.simulate import FORECASTS, SimSpec, simulate
from moepager.trace.workload import Cut, Workload, load_workload, parse_requests

HELP = "replay a routing trace through cache policies: hit rates, traffic and modeled TPOT/TTFT"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file (moepager trace convert ... or generate --record-trace)")
    p.add_argument("--policy", default="lru", help=f"comma-separated, from {sorted(POLICIES)} (default lru)")
    p.add_argument("--capacity", default="8",
                   help="comma-separated cache sizes: experts (per layer with --scope layer, total with global) "
                        "or bytes such as 4GiB (a total budget, split evenly over layers with --scope layer)")
    p.add_argument("--scope", choices=["layer", "global"], default="layer", help="per-layer caches or one cache")
    p.add_argument("--order", choices=["decode", "recorded"], default="decode",
                   help="decode: every token is a step; recorded: a request's prefill is one step")
    p.add_argument("--batch", type=int, default=1, help="requests decoded together (continuous batching)")
    p.add_argument("--requests", help="replay only these requests: A:B (end exclusive), e.g. 0:100")
    p.add_argument("--route-prompt", type=int, metavar="N",
                   help="the first N tokens of each request are its prompt, the rest decode steps (as generate "
                        "--route-from ... --route-prompt N replays them)")
    p.add_argument("--decode-steps", type=int, metavar="N", help="keep N decode steps of each request")
    p.add_argument("--layers", type=int, metavar="N", help="keep the trace's first N MoE layers")
    p.add_argument("--warm", action="store_true",
                   help="start with the cache filled as the engine's warm start fills it (default: empty, as --cold)")
    p.add_argument("--forecast", choices=FORECASTS, default="none",
                   help="next-step experts for fmoe probabilities and smoe prefetch (default none)")
    p.add_argument("--prior", help="frequency prior: a trace file (its request counts) or FILE:NAME of its priors")
    p.add_argument("--profile", metavar="NAME|FILE.json",
                   help=f"hardware profile for modeled TPOT/TTFT: one of {', '.join(sorted(PROFILES))}, or a "
                        f"profile `moepager calibrate --out` wrote")
    p.add_argument("--overlap", choices=["layer", "none"], default="layer", help="cost model: load/compute overlap")
    p.add_argument("--expert-bytes", type=int, help="bytes per expert, if the trace header lacks it")
    p.add_argument("--dense-bytes-per-layer", type=int, default=0, help="cost model: non-expert weights per layer")
    p.add_argument("--json", help="write the rows (with per-layer hit rates) to this JSON file")
    p.add_argument("--plot", help="write hit rate vs capacity per policy to this PNG")


def load_prior(text: str | None, work: Workload) -> np.ndarray | None:
    if not text:
        return None
    path, _, name = text.partition(":") if not Path(text).exists() else (text, "", "")
    if name:
        with TraceReader(path) as reader:
            prior = reader.prior(name)
            layers = reader.header.moe_layers
        full = np.zeros((work.header.num_layers, work.header.num_experts))
        for row, layer in enumerate(layers):  # a prior may cover some layers only (OLMoE's 0/7/15)
            if layer in work.header.moe_layers and prior.shape[1] == work.header.num_experts:
                full[work.header.moe_layers.index(layer)] = prior[row]
        if not full.any():
            raise TraceError(f"prior {text} covers none of the trace's layers / experts")
        return full
    prior = load_workload(path).counts_LE()
    if prior.shape != (work.header.num_layers, work.header.num_experts):
        raise TraceError(f"prior {path} has {prior.shape} layers x experts; the trace has "
                         f"{(work.header.num_layers, work.header.num_experts)}")
    return prior


def capacities(text: str, work: Workload, expert_bytes: int, scope: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if item.isdigit():
            out.append(int(item))
            continue
        if not expert_bytes:
            raise TraceError(f"capacity '{item}' is in bytes but the trace has no bytes per expert; "
                             "pass --expert-bytes or give experts")
        experts = Budget.parse(item, "--capacity").slots(expert_bytes, work.header.num_layers * work.header.num_experts)
        out.append(experts // work.header.num_layers if scope == "layer" else experts)
    return out


def run(args: argparse.Namespace) -> int:
    cut = Cut(args.route_prompt, args.decode_steps, args.layers)
    work = load_workload(args.trace, args.order, args.batch, parse_requests(args.requests) if args.requests else None,
                         cut)
    expert_bytes = args.expert_bytes or work.header.expert_bytes
    prior = load_prior(args.prior, work)
    cost = None
    if args.profile:
        try:
            cost = CostModel.profile(args.profile, expert_bytes, num_shared=work.header.num_shared,
                                     dense_bytes_per_layer=args.dense_bytes_per_layer, overlap=args.overlap)
        except ValueError as e:
            raise TraceError(str(e)) from None
    policies = [p.strip() for p in args.policy.split(",")]
    for name in policies:
        if name not in POLICIES:
            raise TraceError(f"unknown eviction policy '{name}'; choose from {sorted(POLICIES)}")
    specs = [SimSpec(p, c, args.scope, args.forecast, warm=args.warm) for p in policies
             for c in capacities(args.capacity, work, expert_bytes, args.scope)]
    print(f"{args.trace}: {len(work.names)} requests, {len(work.phase_N)} tokens, {work.num_steps} steps, "
          f"{work.header.num_layers} layers x {work.header.num_experts} experts, top-{work.header.top_k}")
    rows = []
    for spec in tqdm(specs, desc="simulating", unit="run"):
        rows.append(summary(simulate(work, spec, prior), work, cost))
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"trace": args.trace, "header": vars(work.header),
                                               "profile": args.profile, "rows": rows}, indent=1, default=list))
    if args.plot:
        plot_hit_rates(rows, args.plot, f"{work.header.model}: hit rate vs cache size")
        print(f"plot: {args.plot}")
    return 0
