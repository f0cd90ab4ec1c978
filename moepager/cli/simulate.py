"""`moepager simulate TRACE`: replay a routing trace against cache policies and sizes; table, JSON and plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from moepager.atomic_io import atomic_file, check_file
from moepager.cli.predictor import parse_ints
from moepager.config import (
    BATCH_POLICIES,
    HYBRID_PREFILLS,
    WORKER_ASSIGNS,
    WORKER_PREFILLS,
    Budget,
    SchedulerConfig,
)
from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Placement
from moepager.planning.cost import LINKS, PROFILES, CostModel
from moepager.planning.od_moe import (
    Cluster,
    crowded_calls,
    group_cache,
    prefill_times,
    resident_step_times,
    step_times,
    worker_shares,
)
from moepager.policies import POLICIES
from moepager.predictors import FITTED, PredictorError, make_predictor
from moepager.runtime.step_order import engine_steps
from moepager.store.budget import format_bytes
from moepager.trace.format import DECODE, PREFILL, TraceError, TraceReader
from moepager.trace.predict import replay_forecasts
from moepager.trace.report import format_table, plot_hit_rates, summary, with_gaps
from moepager.trace.simulate import FORECASTS, Forecasts, SimSpec, check_spec, simulate
from moepager.trace.workload import Cut, Workload, chosen_requests, load_workload, parse_requests

PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
"""The picture formats `--plot` writes (matplotlib's, by the file's suffix)."""
HELP = "replay a routing trace through cache policies: hit rates, traffic and modeled TPOT/TTFT"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file (moepager trace convert ... or generate --record-trace)")
    p.add_argument("--policy", default="lru", help=f"comma-separated, from {sorted(POLICIES)} (default lru)")
    p.add_argument("--capacity", default="8",
                   help="comma-separated cache sizes: experts (per layer with --scope layer, total with global) "
                        "or bytes such as 4GiB (a total budget, split evenly over layers with --scope layer)")
    p.add_argument("--scope", choices=["layer", "global"], default="layer", help="per-layer caches or one cache")
    p.add_argument("--order", choices=["decode", "recorded", "engine"], default="decode",
                   help="decode: every token is a step; recorded: a request's prefill is one step; engine: the passes "
                        "the engine's scheduler runs (chunked prompts beside decodes, --batch requests at a time as "
                        "generate --route-concurrency feeds them; needs --route-prompt)")
    p.add_argument("--batch", type=int, default=1,
                   help="requests decoded together (continuous batching); with --order engine, the concurrency")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig().max_num_seqs,
                   help="--order engine: the scheduler's request limit")
    p.add_argument("--max-batched-tokens", type=int, default=SchedulerConfig().max_batched_tokens,
                   help="--order engine: the scheduler's token budget")
    p.add_argument("--batch-policy", choices=BATCH_POLICIES, default="fifo",
                   help="--order engine: the scheduler's batch policy (fifo or expertflow)")
    p.add_argument("--requests", help="replay only these requests: A:B (end exclusive), e.g. 0:100")
    p.add_argument("--route-prompt", type=int, metavar="N",
                   help="the first N tokens of each request are its prompt, the rest decode steps (as generate "
                        "--route-from ... --route-prompt N replays them)")
    p.add_argument("--decode-steps", type=int, metavar="N", help="keep N decode steps of each request")
    p.add_argument("--layers", type=int, metavar="N", help="keep the trace's first N MoE layers")
    p.add_argument("--warm", action="store_true",
                   help="start with the cache filled as the engine's warm start fills it (default: empty, as --cold)")
    p.add_argument("--forecast", choices=FORECASTS, default="none",
                   help="next-step experts for fmoe/plec probabilities and smoe prefetch (default none); "
                        "predictor: a fitted predictor's forecasts (--predictor, --predictor-file)")
    p.add_argument("--horizon", default="1", metavar="H[,H...]",
                   help="--forecast oracle: the true experts of the next H steps, not only the next one's "
                        "(comma-separated to compare; default 1): what a perfect forecast H tokens ahead is worth")
    p.add_argument("--predictor", choices=FITTED, help="--forecast predictor: which fitted predictor")
    p.add_argument("--predictor-file", help="--forecast predictor: the file `moepager predictor fit` wrote")
    p.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="--forecast predictor: load the forecast's N most likely experts of each layer before it "
                        "runs (PLEC's layer-order prefetch; default 0: eviction only)")
    p.add_argument("--prefetch-distance", type=int, default=1, metavar="D",
                   help="--prefetch: forecasts made D MoE layers ahead (default 1)")
    p.add_argument("--prior", help="frequency prior: a trace file (its request counts) or FILE:NAME of its priors")
    p.add_argument("--profile", metavar="NAME|FILE.json",
                   help=f"hardware profile for modeled TPOT/TTFT: one of {', '.join(sorted(PROFILES))}, or a "
                        f"profile `moepager calibrate --out` wrote")
    p.add_argument("--execution", default="gpu", metavar="gpu|hybrid|hybrid+admitN[,...]",
                   help="where missing experts compute (comma-separated to compare): gpu (each is loaded) or hybrid "
                        "(the engine's --execution hybrid: one with fewer of the step's tokens than the --profile's "
                        "threshold computes on the CPU without a transfer, the rest are loaded); hybrid+admitN: then "
                        "copies up to N of a layer's CPU experts to the device in the background (the engine's "
                        "--hybrid-admit N)")
    p.add_argument("--hybrid-prefill", choices=HYBRID_PREFILLS, default="ping-pong",
                   help="hybrid: a prefill's heavy misses pass through uncached and the first decode step loads each "
                        "layer's most activated experts of the prefill (ping-pong, the engine's default), or they are "
                        "admitted as a decode's are (cache): the engine's --hybrid-prefill")
    add_worker_arguments(p)
    p.add_argument("--overlap", choices=["layer", "none"], default="layer", help="cost model: load/compute overlap")
    p.add_argument("--expert-bytes", type=int, help="bytes per expert, if the trace header lacks it")
    p.add_argument("--dense-bytes-per-layer", type=int, default=0, help="cost model: non-expert weights per layer")
    p.add_argument("--json", help="write the rows (with per-layer hit rates) to this JSON file")
    p.add_argument("--plot", help="write hit rate vs capacity per policy to this PNG")
    p.add_argument("--force", action="store_true", help="replace an existing --json or --plot file")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """`--workers` and its options: OD-MoE worker machines on paper."""
    g = p.add_argument_group("OD-MoE worker machines, on paper (planning/od_moe.py)")
    g.add_argument("--workers", metavar="N[,N...]",
                   help="also model decoding the trace on N worker machines (OD-MoE's pipeline; cacheless unless "
                        "--worker-cache), each with "
                        "the --profile's device and link; comma-separated to compare")
    g.add_argument("--worker-group", type=int, metavar="G", help="--workers: machines per layer (default top-k)")
    g.add_argument("--worker-assign", default="one-to-one", metavar="A[,A...]",
                   help="--workers: how a call's experts go to its group's machines, as the engine's --worker-assign: "
                        "one-to-one (OD-MoE's, the default) or fixed (each expert on one machine); comma-separated "
                        "to compare")
    g.add_argument("--shadow-recall", type=float, default=0.0, metavar="R",
                   help="--workers: the share of routed experts a shadow model predicts (OD-MoE's INT8 shadow: "
                        "0.9734; default 0, no shadow)")
    g.add_argument("--network", choices=sorted(LINKS), default="1gbe",
                   help="--workers: the link between the main machine and the workers (default 1gbe)")
    g.add_argument("--main-layer-ms", type=float, default=0.25, metavar="MS",
                   help="--workers: the main machine's time for one layer's attention, gating and norms (default "
                        "0.25, Mixtral-8x7B on an RTX 3090)")
    g.add_argument("--worker-cache", type=int, default=0, metavar="C",
                   help="--workers: experts each worker keeps across steps (the engine's --worker-memory; replayed "
                        "with LRFU per layer); default 0, cacheless as OD-MoE runs")
    g.add_argument("--worker-prefill", metavar="P[,P...]",
                   help="--workers: also model the trace's prompts (OD-MoE §2.7: every routed expert loaded on "
                        "demand) with a prompt's layer calls on the layer's group (group) or spread over every "
                        "machine (spread), as the engine's --worker-prefill; comma-separated to compare")
    g.add_argument("--hidden-bytes", type=int, default=8192,
                   help="--workers: one token's hidden state on the wire (default 8192: 4096 fp16 values)")


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


def predicted(args: argparse.Namespace, work: Workload, cut: Cut) -> Forecasts | None:
    """A fitted predictor's forecasts over the replayed requests (--forecast predictor), made before any run."""
    if args.forecast != "predictor":
        if args.predictor or args.prefetch:
            raise TraceError("--predictor and --prefetch replay a fitted predictor's forecasts: add --forecast "
                             "predictor")
        return None
    if not args.predictor or not args.predictor_file:
        raise TraceError("--forecast predictor needs --predictor NAME and --predictor-file PATH")
    if cut != Cut():
        raise TraceError("--forecast predictor replays whole requests as recorded; drop --route-prompt, "
                         "--decode-steps and --layers (cut the trace with `trace` tools first)")
    h = work.header
    predictor = make_predictor(args.predictor, num_layers=h.num_layers, num_experts=h.num_experts,
                               file=args.predictor_file, distance=args.prefetch_distance)
    with TraceReader(args.trace) as reader:
        chosen = chosen_requests(parse_requests(args.requests) if args.requests else None, len(reader), args.trace)
        with tqdm(total=len(chosen), desc=f"{args.predictor} forecasts", unit="request", leave=False) as bar:
            return replay_forecasts(predictor, reader, chosen, work.request_N,
                                    args.prefetch_distance if args.prefetch else None, bar.update)


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
        held = experts // work.header.num_layers if scope == "layer" else experts
        if held < work.header.top_k:
            where = "per layer" if scope == "layer" else "in all"
            least = work.header.top_k * expert_bytes * (work.header.num_layers if scope == "layer" else 1)
            raise TraceError(f"--capacity {item} holds {held} experts {where} ({format_bytes(expert_bytes)} each), "
                             f"below one token's top-{work.header.top_k}; give at least {format_bytes(least)}")
        out.append(held)
    return out


def executions(text: str, cost: CostModel | None) -> list[tuple[Literal["gpu", "hybrid"], int | None, int]]:
    """`--execution`'s items: (execution, for hybrid the fewest tokens that send a missing expert to the device (from
    the cost model: hybrid needs --profile), whether the CPU's experts are then admitted in the background)."""
    out: list[tuple[Literal["gpu", "hybrid"], int | None, int]] = []
    for item in (t.strip() for t in text.split(",")):
        name, _, admit = item.partition("+admit")
        if item == "gpu":
            out.append(("gpu", None, 0))
        elif name == "hybrid" and (admit == "" or admit.isdigit()):
            if cost is None:
                raise TraceError(f"--execution {item} places each missing expert by the cost model: give --profile")
            n = (int(admit) if admit else 1) if "+admit" in item else 0
            out.append(("hybrid", cost.expert_times(on_cpu=cost.device_is_cpu).threshold(), n))
        else:
            raise TraceError(f"--execution '{item}': choose gpu, hybrid or hybrid+admitN (comma-separated to "
                             "compare)")
    return out


def workers_table(args: argparse.Namespace, work: Workload, cost: CostModel | None, expert_bytes: int) -> str:
    """`--workers`: the trace decoded by N worker machines (OD-MoE's pipeline, planning/od_moe.py; cacheless, or with
    `--worker-cache` experts each, replayed) against every expert in one machine's memory, modeled."""
    if cost is None:
        raise TraceError("--workers models each worker with the --profile's device and link: give --profile")
    h = work.header
    group = args.worker_group or h.top_k
    routed = work.routed_SLE()
    requested, tokens = routed.sum(2), np.diff(work.step_ptr)
    main_s = args.main_layer_ms / 1e3
    alone = resident_step_times(cost.device, main_s, requested, tokens, expert_bytes, h.top_k).mean()
    if args.worker_cache < 0:
        raise TraceError(f"--worker-cache must be >= 0, got {args.worker_cache}")
    cache = f", {args.worker_cache} experts cached on each worker (LRFU)" if args.worker_cache else ", cacheless"
    assigns = [a.strip() for a in args.worker_assign.split(",")]
    if not assigns or any(a not in WORKER_ASSIGNS for a in assigns):
        raise TraceError(f"--worker-assign '{args.worker_assign}': choose {' or '.join(WORKER_ASSIGNS)} "
                         "(comma-separated to compare)")
    lines = [f"OD-MoE on paper: {cost.device.name} workers over {cost.link.name}, {LINKS[args.network].name} to the "
             f"main machine, groups of {group}, shadow recall {args.shadow_recall:g}{cache}; all in one machine's "
             f"memory {1 / alone:.2f} tok/s",
             "workers  assign      tok/s  x all in memory  loads / layer call  crowded calls"]
    for n in parse_ints(args.workers, "--workers"):
        try:
            cluster = Cluster(n, min(group, n), cost.device, cost.link, LINKS[args.network], main_s,
                              args.shadow_recall)
        except MoepagerError as e:
            raise TraceError(str(e)) from None
        loaded = requested
        per_layer = group_cache(cluster, h.num_layers, h.num_experts, args.worker_cache)
        if per_layer >= h.top_k:  # (a smaller share keeps no layer's experts of one token: cacheless)
            result = simulate(work, SimSpec("lrfu", per_layer))
            loaded = result.requested_SL - result.hits_SL
        for assign in assigns:
            share = worker_shares(routed, Placement.of(n, cluster.group_size, assign))
            crowded = 100 * crowded_calls(share, requested, cluster.group_size)
            t = step_times(cluster, requested, tokens, expert_bytes, args.hidden_bytes, h.top_k, loaded, share).mean()
            lines.append(f"{n:>7}  {assign:<10}  {1 / t:>5.2f}  {alone / t:>15.3f}  {loaded.mean():>18.2f}  "
                         f"{crowded:>12.1f}%"
                         + (f"  (a group caches {per_layer} of a layer's experts)" if per_layer >= h.top_k else ""))
    if args.worker_prefill:
        lines += prompts_table(args, work, cost, expert_bytes, group)
    return "\n".join(lines)


def prompts_table(args: argparse.Namespace, work: Workload, cost: CostModel, expert_bytes: int, group: int
                  ) -> list[str]:
    """`--worker-prefill`: the trace's prompt chunks on N worker machines (planning/od_moe.py `prefill_times`), each
    mode against keeping a prompt's calls to the layer's group."""
    modes = [m.strip() for m in args.worker_prefill.split(",")]
    if not modes or any(m not in WORKER_PREFILLS for m in modes):
        raise TraceError(f"--worker-prefill '{args.worker_prefill}': choose {' or '.join(WORKER_PREFILLS)} "
                         "(comma-separated to compare)")
    prompts = work.step_phase == PREFILL
    if not prompts.any():
        raise TraceError(f"--worker-prefill models the trace's prompt passes, and these steps (--order "
                         f"{args.order}) have none: use --order recorded or engine (decode replays every token as a "
                         "step of its own), with --route-prompt N where the trace records no prompt")
    h = work.header
    routed = work.routed_SLE()[prompts]
    requested, tokens = routed.sum(2), np.diff(work.step_ptr)[prompts]
    lines = [f"prompts: {int(prompts.sum())} chunks, {tokens.mean():.1f} tokens on average, every routed expert "
             "loaded on demand (no forecast, no cache)",
             "workers  prefill  prompt ms  x group"]
    for n in parse_ints(args.workers, "--workers"):
        cluster = Cluster(n, min(group, n), cost.device, cost.link, LINKS[args.network], args.main_layer_ms / 1e3,
                          0.0)
        times = {}
        for mode in dict.fromkeys(["group", *modes]):
            share = worker_shares(routed, Placement.of(n, cluster.group_size, prefill=mode), "prefill")
            times[mode] = float(prefill_times(cluster, requested, tokens, expert_bytes, args.hidden_bytes, h.top_k,
                                              share).mean())
        lines += [f"{n:>7}  {mode:<7}  {1e3 * times[mode]:>9.2f}  {times[mode] / times['group']:>7.3f}"
                  for mode in modes]
    return lines


def horizons(text: str) -> list[int]:
    try:
        return parse_ints(text, "--horizon")
    except PredictorError:
        raise TraceError(f"--horizon '{text}' must be whole numbers of steps, 1 or more, e.g. 1,4,16") from None


def workload(args: argparse.Namespace, cut: Cut) -> Workload:
    """The trace's steps in the order asked for (`--order engine`: the engine's scheduler's passes)."""
    chosen = parse_requests(args.requests) if args.requests else None
    if args.order == "engine":
        if args.route_prompt is None:
            raise TraceError("--order engine schedules each request's prompt and decode steps: give --route-prompt N")
        scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                                    batch_policy=args.batch_policy)
        work = engine_steps(load_workload(args.trace, "recorded", 1, chosen, cut), scheduler, args.batch)
    else:
        defaults = SchedulerConfig()
        given = [flag for flag, value, default in (("--max-num-seqs", args.max_num_seqs, defaults.max_num_seqs),
                                                   ("--max-batched-tokens", args.max_batched_tokens,
                                                    defaults.max_batched_tokens),
                                                   ("--batch-policy", args.batch_policy, "fifo")) if value != default]
        if given:
            raise TraceError(f"{', '.join(given)} schedule the engine's passes: add --order engine")
        work = load_workload(args.trace, args.order, args.batch, chosen, cut)
    return work


def run(args: argparse.Namespace) -> int:
    inputs = {"TRACE": args.trace, "--profile": args.profile, "--prior": args.prior}
    json_out = check_file(args.json, "--json", args.force, inputs)
    plot_out = check_file(args.plot, "--plot", args.force, inputs)
    if plot_out is not None and plot_out.suffix.lower() not in PLOT_SUFFIXES:
        raise MoepagerError(f"--plot {plot_out}: name a picture file ({', '.join(PLOT_SUFFIXES)}); matplotlib "
                            "writes the format its suffix names")
    if plot_out is not None:
        require_matplotlib("--plot")
    if args.worker_prefill and not args.workers:
        raise TraceError("--worker-prefill models the prompts on worker machines: add --workers N")
    cut = Cut(args.route_prompt, args.decode_steps, args.layers)
    work = workload(args, cut)
    expert_bytes = args.expert_bytes or work.header.expert_bytes
    prior = load_prior(args.prior, work)
    cost = None
    if args.profile:
        try:
            cost = CostModel.profile(args.profile, expert_bytes, num_shared=work.header.num_shared,
                                     dense_bytes_per_layer=args.dense_bytes_per_layer, overlap=args.overlap)
        except ValueError as e:
            raise TraceError(str(e)) from None
    sizes, windows = capacities(args.capacity, work, expert_bytes, args.scope), horizons(args.horizon)
    placed = executions(args.execution, cost)
    specs = [SimSpec(p.strip(), c, args.scope, args.forecast, warm=args.warm, prefetch=args.prefetch, horizon=h,
                     execution=x, device_tokens=n, admit=a, hybrid_prefill=args.hybrid_prefill)
             for x, n, a in placed for p in args.policy.split(",") for c in sizes for h in windows]
    if any(x == "hybrid" for x, _, _ in placed) and cost is not None:
        times = cost.expert_times(on_cpu=cost.device_is_cpu)
        print(f"hybrid placement ({args.profile}): {times.describe()}")
    for spec in specs:  # every run's needs, before the first one starts
        check_spec(spec, work.header, prior)
    replayed = predicted(args, work, cut)
    h = work.header
    steps = ("order decode: every token replayed as its own step" if args.order == "decode" and args.batch == 1
             and args.route_prompt is None else f"order {args.order}, batch {args.batch}")
    print(f"{args.trace}: {len(work.names)} requests, {len(work.phase_N)} tokens "
          f"({int((work.phase_N == DECODE).sum())} recorded as decode), {work.num_steps} steps ({steps}), "
          f"{h.num_layers} layers x {h.num_experts} experts, top-{h.top_k}")
    rows: list[dict] = []
    try:
        with tqdm(total=len(specs) * work.num_steps, desc="simulating", unit="step", unit_scale=True) as bar:
            for spec in specs:
                done = bar.n
                rows.append(summary(simulate(work, spec, prior, lambda s: bar.update(done + s - bar.n), replayed),
                                    work, cost))
                bar.update(done + work.num_steps - bar.n)
    finally:  # what finished is printed and saved even when a later run fails or is interrupted
        if rows:
            print(format_table(rows))
            if json_out is not None:
                with atomic_file(json_out) as tmp:
                    tmp.write_text(json.dumps({"trace": args.trace, "header": vars(h), "profile": args.profile,
                                               "rows": with_gaps(rows)}, indent=1, default=list))
    if args.workers:
        print(workers_table(args, work, cost, expert_bytes))
    if plot_out is not None:
        with atomic_file(plot_out) as tmp:
            plot_hit_rates(rows, tmp, f"{h.model}: hit rate vs cache size")
        print(f"plot: {plot_out}")
    return 0


def require_matplotlib(flag: str) -> None:
    """Plots need matplotlib (in the bench and test extras, not the main install): say so before any work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MoepagerError(f"{flag} needs matplotlib: pip install -e '.[bench]' (or drop {flag})") from None
