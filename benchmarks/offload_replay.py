"""Offloading on replayed real routing: budgets x policies x predictors, measured and modeled side by side.

The harness behind benchmarks/offload_cpu.py and offload_gpu.py. Model: `make-model --preset deepseek-v2-lite
--layers N+1` (the real geometry: 64 routed experts of 16.5 MiB, top-6, 2 shared experts, MLA attention;
layer 0 dense, so N MoE layers) in bf16. Routing: the DeepSeek-V2-Lite trace in ../shared/traces/ (2,099
prompts recorded as one forward pass each), its first N MoE layers replayed with `--route-prompt P`: each
request's first P tokens are its prompt, the next D tokens decode steps. Replayed requests come from the end
of the trace; predictors are fitted on the first requests (disjoint from the replayed ones). Every
configuration is a fresh engine (warm start, as `generate` runs) replaying the same requests, one at a time.
In the same run: `moepager calibrate` on the model before and after the configurations (the profile used is
their mean: this shared machine drifts), and for every configuration without a predictor the simulator's
TPOT on the same trace, cut, policy and cache size (warm start) with that profile: the calibrated cost model
must land within +-20% of the measured TPOT (`--repeat N` runs the whole list N times, interleaved, and judges
the model against each configuration's median). A second table: TTFT of one 512-token prompt at every budget
(LRU), run twice on one engine: the second run measured and modeled (the first, cold run printed beside it).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS, SHARED, converted, ensure_model, machine_state, print_table, write_json
from moepager.checkpoints.quantized import quantize_checkpoint
from moepager.config import PrefetchConfig, StoreConfig
from moepager.planning.calibrate import CalibrateOptions, DiskSampler, calibrate
from moepager.planning.cost import CalibratedProfile, CostModel
from moepager.predictors import PREDICTORS
from moepager.predictors.head import DEFAULT_HIDDEN
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec
from moepager.trace.fit import FITTERS
from moepager.trace.format import TraceReader, TraceWriter
from moepager.trace.report import step_seconds, summary
from moepager.trace.simulate import SimSpec, simulate
from moepager.trace.workload import Cut, load_workload

TOLERANCE = 0.20
HeadFit = Literal["plain", "tokens", "mlp"]
HEAD_FITS: dict[HeadFit, int] = {"plain": 0, "tokens": 0, "mlp": DEFAULT_HIDDEN}
"""The head predictor's fits: the hidden width of its MLP (plain also leaves the token out)."""


@dataclass(frozen=True)
class Config:
    budget: str
    policy: str = "lru"
    predictor: str | None = None
    per_row: int | None = None
    """Experts prefetched per forecast row (None: --prefetch-k or the model's top-k; 0: forecasts rank evictions
    only)."""
    inflight: int | None = None
    """Prefetches loading at once, at most (None: the engine's default, twice the model's top-k)."""
    distance: int | None = None
    """Prefetch distance in MoE layers (None: the predictor's default)."""
    threads: int = 1
    """Threads of the prefetch lane (--prefetch-threads)."""
    min_p: float = 0.0
    """Probability floor of what is prefetched (--prefetch-min-p)."""
    head: HeadFit = "tokens"
    """How the head predictor is fitted (HEAD_FITS, --head-fits)."""
    yields: bool = True
    """Prefetches give way to demand loads between their chunks too (StoreConfig.prefetch_yields)."""

    @property
    def label(self) -> str:
        k = "" if self.distance is None else f" d{self.distance}"
        k += "" if self.per_row is None else f" k{self.per_row}"
        k += "" if self.inflight is None else f"/{self.inflight}"
        k += "" if self.threads == 1 else f" t{self.threads}"
        k += "" if not self.min_p else f" p{self.min_p:g}"
        k += "" if self.head == "tokens" or self.predictor != "head" else f" {self.head}"
        k += "" if self.yields or not self.predictor else " no-yield"
        return f"{self.budget} {self.policy}" + (f" +{self.predictor}{k}" if self.predictor else "")


def arguments(device: str, layers: int, threads: int | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=layers, help="MoE layers of the model (and of the trace replayed)")
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2, help="requests replayed per configuration")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request (--route-prompt)")
    ap.add_argument("--decode", type=int, default=48, help="decode steps per request")
    ap.add_argument("--ttft-prompt", type=int, default=512)
    ap.add_argument("--budgets", nargs="+", default=["100%", "50%", "25%", "12.5%"],
                    help="fractions of the paged format's expert bytes (see --experts)")
    ap.add_argument("--experts", default="bf16", choices=["bf16", "int8", "int4"],
                    help="page the checkpoint's experts in this format: int8/int4 from its `moepager quantize` copy "
                         "(made once; lossy), so disk reads shrink too")
    ap.add_argument("--policies", nargs="+", default=["lru", "lfu", "lcp"])
    ap.add_argument("--predictors", nargs="+", default=["none", "transition", "expert-map"])
    ap.add_argument("--all-combinations", action="store_true",
                    help="every policy with every predictor (default: predictors with the first policy only)")
    ap.add_argument("--fit-requests", type=int, default=1500, help="trace requests the predictors are fitted on")
    ap.add_argument("--prefetch-k", type=int, help="experts prefetched per forecast row (default: the model's top-k)")
    ap.add_argument("--out", help="results name (default: the script's)")
    ap.add_argument("--no-ttft", action="store_true", help="skip the TTFT table")
    ap.add_argument("--configs", nargs="+", metavar="POLICY[+PREDICTOR[@D][:K[/N]]]",
                    help="exactly these configurations at every budget below 100%% (instead of --policies x "
                         "--predictors), e.g. lru plec+head:0 plec+head:6/1 lru+replay-oracle@8 (D: prefetch distance "
                         "in MoE layers; K experts prefetched per row, at most N loading at once; replay-oracle "
                         "forecasts the replayed routing itself: a perfect predictor's upper bound)")
    ap.add_argument("--prefetch-threads", type=int, nargs="+", default=[1], metavar="T",
                    help="run every configuration with a predictor once per prefetch lane width T (default 1)")
    ap.add_argument("--prefetch-min-p", type=float, nargs="+", default=[0.0], metavar="P",
                    help="run every configuration with a predictor once per probability floor P (default 0)")
    ap.add_argument("--prefetch-yield", nargs="+", choices=["on", "off"], default=["on"],
                    help="run every configuration with a predictor with prefetches that give way to demand loads "
                         "between their chunks (on, the engine's default) and/or that read on to the end (off)")
    ap.add_argument("--head-fits", nargs="+", choices=list(HEAD_FITS), default=["tokens"],
                    help="run every configuration with the head predictor once per fit: linear without the token "
                         "(plain), linear with the trace's tokens (tokens: a replay hands predictors the recorded "
                         "tokens), or with an MLP of 256 hidden units added (mlp)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the configurations this many times, interleaved (A B A B ...: the disk drifts)")
    ap.add_argument("--paired", action="store_true",
                    help="with --configs: run the first configuration again after every other one (A B A C A ...), "
                         "so each is compared with the baseline runs right before and after it")
    ap.add_argument("--remodel", action="store_true",
                    help="measure nothing: re-evaluate the cost model on the last run's measurements and profile "
                         "(after a change to the model, not to the constants)")
    ap.set_defaults(device=device)
    return ap


def configs(args: argparse.Namespace) -> list[Config]:
    if args.configs:
        resident = [Config(b) for b in args.budgets if b in ("100%", "all")]
        paged = [parse_config(b, c) for b in args.budgets if b not in ("100%", "all") for c in args.configs]
        one_round = variants(paged, args)
        return resident + (paired(one_round, args.repeat) if args.paired else one_round * args.repeat)
    out = []
    predictors = [None if p == "none" else p for p in args.predictors]
    for budget in args.budgets:
        if budget in ("100%", "all"):
            out.append(Config(budget))
            continue
        for i, policy in enumerate(args.policies):
            for predictor in predictors:
                if predictor is None or i == 0 or args.all_combinations:
                    out.append(Config(budget, policy, predictor))
    return variants(out, args) * args.repeat


def paired(one_round: list[Config], repeat: int) -> list[Config]:
    """`repeat` rounds with the round's first configuration (the baseline) run again after each other one: A B A C A
    ... A, so every configuration has a baseline run just before and just after it (the disk drifts over minutes;
    `report` compares each run with its two neighbouring baseline runs)."""
    base, rest = one_round[0], one_round[1:]
    out = [base]
    for _ in range(repeat):
        for c in rest:
            out += [c, base]
    return out


def neighbour_ratios(rows: list[dict]) -> dict[str, list[float]]:
    """Per configuration, each run's speed-up over the baseline (the first paged configuration, its budget in its
    label) runs nearest before and after it: the mean of their TPOTs over its own."""
    paged = [r for r in rows if r["per_layer"] is not None]
    if not paged:
        return {}
    base = paged[0]["config"]
    out: dict[str, list[float]] = {}
    for i, r in enumerate(paged):
        if r["config"] == base:
            continue
        near = [next((b for b in side if b["config"] == base), None)
                for side in (reversed(paged[:i]), paged[i + 1:])]
        tpots = [b["tpot_ms"] for b in near if b is not None]
        if tpots:
            out.setdefault(r["config"], []).append(statistics.mean(tpots) / r["tpot_ms"])
    return out


def variants(configs: list[Config], args: argparse.Namespace) -> list[Config]:
    """Each configuration with a predictor once per prefetch lane width and probability floor, side by side; the
    others once."""
    out = []
    for c in configs:
        widths, floors = (args.prefetch_threads, args.prefetch_min_p) if c.predictor else ([1], [0.0])
        heads = args.head_fits if c.predictor == "head" else ["tokens"]
        yields = [y == "on" for y in args.prefetch_yield] if c.predictor else [True]
        out += [replace(c, threads=t, min_p=p, head=h, yields=y) for t in widths for p in floors for h in heads
                for y in yields]
    return out


def parse_config(budget: str, text: str) -> Config:
    """POLICY[+PREDICTOR[@D][:K[/N]]] at `budget`."""
    policy, _, rest = text.partition("+")
    predictor, _, k = rest.partition(":")
    predictor, _, d = predictor.partition("@")
    k, _, n = k.partition("/")
    return Config(budget, policy, predictor or None, int(k) if k else None, int(n) if n else None,
                  int(d) if d else None)


def quantized(path: Path, fmt: str) -> Path:
    """The checkpoint a format pages from: `moepager quantize`'s output (made once), so disk reads shrink too."""
    if fmt == "bf16":
        return path
    out = path.with_name(f"{path.name}-{fmt}")
    if not (out / "config.json").exists():
        quantize_checkpoint(path, out, fmt, force=True)
    return out


def deepseek_trace(layers: int) -> Path:
    """The DeepSeek-V2-Lite trace's first `layers` MoE layers, cut once and cached (the full trace is converted
    from ../shared/traces only when the cut is missing, so a machine without the public trace can run from a
    copy of results/traces/)."""
    out = RESULTS / "traces" / f"deepseek-v2-lite-first{layers}.mpt"
    if out.exists():
        return out
    full = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
    cut = Cut(layers=layers)
    tmp = out.with_suffix(".partial")
    with TraceReader(full) as reader, TraceWriter(tmp, cut.header(reader.header)) as writer:
        for i in tqdm(range(len(reader)), desc="cutting trace", unit="request"):
            writer.add(cut.apply(reader.request(i), i))
    tmp.rename(out)
    return out


def fitted_predictors(trace: Path, fit: list[int], wanted: set[tuple[str, HeadFit]]
                      ) -> dict[tuple[str, HeadFit], Path]:
    """A file per (predictor, head fit), fitted once and cached (the head's "plain" file is the one fitted before
    replays handed predictors the trace's tokens)."""
    out, files = RESULTS / "predictors", {}
    out.mkdir(parents=True, exist_ok=True)
    with TraceReader(trace) as reader:
        for name, fit_as in sorted(wanted):
            tag = "" if name != "head" or fit_as == "plain" else f"-{fit_as}"
            path = files[name, fit_as] = out / f"{trace.stem}-fit{len(fit)}-{name}{tag}-v2.pt"
            if path.exists():
                continue
            print(f"fitting {name}{tag} on {len(fit)} requests of {trace.name}")
            # the head also forecasts each layer at the next token (distance L: PLEC's next use)
            options = FITTERS[name].applicable(distances=(1, 2, 3, reader.header.num_layers),
                                               tokens=fit_as != "plain", hidden=HEAD_FITS[fit_as])
            fitted = FITTERS[name].fit(reader, fit, options, lambda advance: None)
            fitted.save(path)
    return files


def replayed_requests(trace: Path, fit: int, count: int, tokens: int, from_end: bool = True) -> list[int]:
    """`count` requests with at least `tokens` tokens, after the first `fit` (taken from the trace's end)."""
    with TraceReader(trace) as reader:
        order = range(len(reader) - 1, fit - 1, -1) if from_end else range(fit, len(reader))
        chosen = []
        for i in order:
            if reader.request(i).num_tokens >= tokens:
                chosen.append(i)
                if len(chosen) == count:
                    return sorted(chosen)
    raise SystemExit(f"{trace} has fewer than {count} requests of {tokens}+ tokens after the first {fit}")


def measure(path: Path, cfg: Config, args: argparse.Namespace, spec: ReplaySpec,
            files: dict[tuple[str, HeadFit], Path], times: int = 1) -> dict:
    store = None if cfg.budget in ("100%", "all") else StoreConfig(expert_memory=cfg.budget, policy=cfg.policy,
                                                                     io_threads=args.io_threads,
                                                                     prefetch_threads=cfg.threads,
                                                                     prefetch_yields=cfg.yields)
    per_row = args.prefetch_k if cfg.per_row is None else cfg.per_row
    key = (cfg.predictor, cfg.head)
    file = str(files[key]) if key in files else None  # replay-oracle and gate-lookahead: none
    prefetch = PrefetchConfig(cfg.predictor, file, distance=cfg.distance, per_row=per_row, max_inflight=cfg.inflight,
                              min_p=cfg.min_p) if cfg.predictor else PrefetchConfig()
    llm = LLM(path, device=args.device, threads=args.threads, store=store, prefetch=prefetch, show_progress=False)
    return {"config": cfg.label, "budget": cfg.budget, "policy": cfg.policy, "predictor": cfg.predictor or "none",
            "prefetch_threads": cfg.threads, "prefetch_min_p": cfg.min_p, "head_fit": cfg.head,
            "prefetch_yields": cfg.yields} | replayed_run(
        llm, spec, args.layers, times)


def replayed_run(llm: LLM, spec: ReplaySpec, layers: int, times: int = 1) -> dict:
    """Replay `spec` on `llm` `times` times and return the last run's figures (with every run's TTFT); the
    store is closed and the model freed after."""
    try:
        ttfts = []
        for _ in range(times):
            llm.replay(spec)
            ttfts.append(1e3 * llm.last_stats.ttft_s)
        s = llm.last_stats
        decoded = s.generated_tokens - s.num_prompts
        experts = s.sections["experts"].to_dict()
        d, pre = experts.get("decode", {}), experts.get("prefill", {})
        slots = experts["config"].get("device slots")
        return {"slots": slots, "per_layer": None if slots is None else slots // layers,
                "expert_bytes": llm.loaded.expert_shape.nbytes,
                "decode_tok_s": decoded / s.decode_s if decoded else None,
                "tpot_ms": 1e3 * s.decode_s / decoded if decoded else None,
                "tpot_median_ms": 1e3 * s.tpot_median_s, "ttft_ms": 1e3 * s.ttft_s, "ttft_runs_ms": ttfts,
                "hit_rate": d.get("hit_rate", 1.0), "disk_MiB_per_token": d.get("bytes_disk_per_token", 0) / 2**20,
                "h2d_MiB_per_token": d.get("bytes_host_to_device_per_token", 0) / 2**20,
                "exposed_ms_per_token": 1e3 * d.get("exposed_s", 0.0) / max(decoded, 1),
                "disk_GBps_in_run": d.get("disk_read_bytes_per_s", 0.0) / 1e9,
                "prefetch_accuracy": d.get("prefetch_accuracy") if d.get("loads_ahead") else None,
                "prefill_hit_rate": pre.get("hit_rate", 1.0),
                "prefill_disk_GBps": pre.get("disk_read_bytes_per_s", 0.0) / 1e9,
                "decoded": decoded}
    finally:
        if llm.loaded.experts is not None and hasattr(llm.loaded.experts, "store"):
            llm.loaded.experts.store.close()
        del llm
        gc.collect()


def modeled(cost: CostModel, trace: Path, requests: list[int], cut: Cut, policy: str, per_layer: int) -> dict:
    work = load_workload(str(trace), "recorded", requests=requests, cut=cut)
    row = summary(simulate(work, SimSpec(policy, per_layer, warm=True)), work, cost)
    return {"tpot_ms": row["tpot_ms"], "ttft_ms": row["ttft_ms"], "hit_rate": row["decode_hit_rate"]}


def main(device: str, layers: int, threads: int | None, name: str) -> None:
    args = arguments(device, layers, threads).parse_args()
    name = args.out or name
    if args.threads:
        torch.set_num_threads(args.threads)
    state = machine_state() | {"threads": torch.get_num_threads(), "device": device}
    if device == "cuda":
        state["gpu"] = torch.cuda.get_device_name()
    path = quantized(ensure_model(f"deepseek-v2-lite-L{args.layers + 1}", "deepseek-v2-lite", args.layers + 1),
                     args.experts)
    trace = deepseek_trace(args.layers)
    fit = list(range(args.fit_requests))
    requests = replayed_requests(trace, args.fit_requests, args.requests, args.prompt + args.decode)
    cut = Cut(args.prompt, args.decode)
    if args.remodel:
        return remodel(name, trace, requests, cut, args)
    spec = ReplaySpec(trace, requests, args.prompt, "match", args.decode)
    wanted = {(c.predictor, c.head) for c in configs(args) if c.predictor and PREDICTORS[c.predictor].fitted}
    files = fitted_predictors(trace, fit, wanted)
    print(f"calibrating {path.name} on {device} (before the runs) ...")
    options = CalibrateOptions(device, args.io_threads, prefill_tokens=args.ttft_prompt)
    before = calibrate(path, options)
    disk = DiskSampler(path, args.io_threads)
    rows = []
    for cfg in tqdm(configs(args), desc="configurations", unit="config"):
        rows.append(measure(path, cfg, args, spec, files))
        if device == "cpu":
            disk.sample()  # the disk drifts during the run: the link is sampled between configurations
    print(f"calibrating {path.name} on {device} (after the runs) ...")
    after = calibrate(path, options)
    profile = averaged(before, after)  # this shared machine drifts over a run: the model gets the run's mean
    if disk.samples:
        for m in (before.measured, after.measured):
            disk.samples.append((m["disk_Bps"], m["disk_single_read_s"]))
        profile = replace(profile, link=disk.link(profile.calibration.expert_bytes))
    disk.close()
    profile.write(RESULTS / f"{name}_profile.json")
    cost = CostModel.profile(str(RESULTS / f"{name}_profile.json"), 0)
    model_rows(rows, cost, trace, requests, cut)
    base = next((r["decode_tok_s"] for r in rows if r["per_layer"] is None), None)
    for r in rows:
        r["vs_resident"] = r["decode_tok_s"] / base if base else None
    ttft = [] if args.no_ttft else ttft_rows(path, trace, args, cost)
    near = neighbour_ratios(rows)
    report(rows, near, ttft, args)
    out = write_json(name, {"machine": state, "model": str(path), "trace": str(trace), "replayed_requests": requests,
                            "fitted_on": f"requests 0:{args.fit_requests}", "args": vars(args),
                            "profile": {"used": asdict(profile), "before": before.measured, "after": after.measured,
                                        "disk_samples": disk.samples},
                            "rows": rows, "vs_neighbouring_baseline": near, "ttft": ttft})
    plot(rows, RESULTS / f"{name}.png", f"{path.name} on {device}, DeepSeek-V2-Lite routing replayed")
    print(f"wrote {out} and {RESULTS / (name + '.png')}")


def model_rows(rows: list[dict], cost: CostModel, trace: Path, requests: list[int], cut: Cut) -> None:
    """The calibrated model's TPOT beside each measured configuration without prefetch."""
    done: dict[tuple[str, int], dict] = {}  # repeats of a configuration share its (deterministic) model
    for row in rows:
        if row["predictor"] == "none":
            key = (row["policy"], row["per_layer"] or 64)
            if key not in done:
                done[key] = modeled(cost, trace, requests, cut, *key)
            row["model"] = done[key]
            row["modeled_tpot_ms"] = row["model"]["tpot_ms"]
            row["model_error"] = row["modeled_tpot_ms"] / row["tpot_ms"] - 1
            if row.get("disk_GBps_in_run"):  # diagnostic: the disk drifts between configurations
                # the store's bytes over disk-busy time is an effective rate: read latency is already inside it
                own = replace(cost, link=replace(cost.link, bytes_per_s=row["disk_GBps_in_run"] * 1e9, latency_s=0.0))
                row["model_own_disk_error"] = modeled(own, trace, requests, cut, row["policy"],
                                                      row["per_layer"])["tpot_ms"] / row["tpot_ms"] - 1


def remodel(name: str, trace: Path, requests: list[int], cut: Cut, args: argparse.Namespace) -> None:
    """The last run's measurements (results/NAME.json) and calibration (results/NAME_profile.json) with the
    current cost model: the modeled columns are recomputed, nothing is measured again."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    data = data.get("results", data)  # the common schema keeps the benchmark's own data under "results"
    if data["replayed_requests"] != requests:
        raise SystemExit(f"results/{name}.json replayed requests {data['replayed_requests']}, not {requests}")
    cost = CostModel.profile(str(RESULTS / f"{name}_profile.json"), 0)
    model_rows(data["rows"], cost, trace, requests, cut)
    request = replayed_requests(trace, args.fit_requests, 1, args.ttft_prompt + 1)
    for t in data["ttft"]:
        per_layer = next(r["per_layer"] for r in data["rows"] if r["budget"] == t["budget"]) or 64
        t |= modeled_ttft(cost, trace, request, args.ttft_prompt, per_layer, t["ttft_ms"])
    data["remodeled"] = "modeled columns recomputed by --remodel from the same measurements and profile"
    report(data["rows"], neighbour_ratios(data["rows"]), data["ttft"], args)
    out = write_json(name, data)
    plot(data["rows"], RESULTS / f"{name}.png", f"{Path(data['model']).name} on {args.device}, DeepSeek-V2-Lite "
                                                f"routing replayed")
    print(f"wrote {out} and {RESULTS / (name + '.png')}")


def averaged(a: CalibratedProfile, b: CalibratedProfile) -> CalibratedProfile:
    """The mean of two calibrations of the same model (every measured number averaged)."""
    def mean(x: Any, y: Any) -> Any:
        if is_dataclass(x):
            return replace(x, **{f.name: mean(getattr(x, f.name), getattr(y, f.name)) for f in fields(x)})
        if isinstance(x, dict):
            return {k: mean(x[k], y[k]) for k in x}
        return (x + y) / 2 if isinstance(x, float) else x
    return mean(a, b)


def ttft_rows(path: Path, trace: Path, args: argparse.Namespace, cost: CostModel) -> list[dict]:
    """One `ttft_prompt`-token prompt per budget (LRU), run twice on the same engine: the second run's TTFT
    (kernels warm, the cache as the first run left it; what a serving process sees) against the model's for
    that second run; the first, cold run's TTFT is kept beside it (one-time kernel setup and page faults)."""
    request = replayed_requests(trace, args.fit_requests, 1, args.ttft_prompt + 1)
    spec = ReplaySpec(trace, request, args.ttft_prompt, "match", 0)
    out = []
    for budget in tqdm(args.budgets, desc=f"TTFT at {args.ttft_prompt} tokens", unit="budget"):
        row = measure(path, Config(budget), args, spec, {}, times=2)
        t = {"budget": budget, "per_layer": row["per_layer"] or 64, "ttft_ms": row["ttft_ms"],
             "cold_ttft_ms": row["ttft_runs_ms"][0], "prefill_hit_rate": row["prefill_hit_rate"],
             "prefill_disk_GBps": row["prefill_disk_GBps"]}
        out.append(t | modeled_ttft(cost, trace, request, args.ttft_prompt, t["per_layer"], t["ttft_ms"]))
    return out


def modeled_ttft(cost: CostModel, trace: Path, request: list[int], prompt: int, per_layer: int,
                 measured_ms: float) -> dict:
    """The model's TTFT for the second of two runs of the prompt (the cache as the first run left it)."""
    work = load_workload(str(trace), "recorded", requests=request * 2, cut=Cut(prompt, 0))
    t_S = step_seconds(simulate(work, SimSpec("lru", per_layer, warm=True)), work, cost)
    modeled_ms = 1e3 * float(t_S[-1])
    return {"modeled_ttft_ms": modeled_ms, "model_error": modeled_ms / measured_ms - 1}


def report(rows: list[dict], near: dict[str, list[float]], ttft: list[dict], args: argparse.Namespace) -> None:
    """The tables; `near`: each configuration's speed-ups over its neighbouring baseline runs (neighbour_ratios)."""
    def opt(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)
    print_table(["config", "experts/layer", "decode tok/s", "vs resident", "TPOT ms", "modeled ms", "model err",
                 "hit %", "disk MiB/tok", "H2D MiB/tok", "exposed ms/tok", "prefetch acc"],
                [[r["config"], opt(r["per_layer"], "d"), r["decode_tok_s"], r["vs_resident"], r["tpot_ms"],
                  opt(r.get("modeled_tpot_ms"), ".1f"), opt(r.get("model_error"), "+.1%"), 100 * r["hit_rate"],
                  r["disk_MiB_per_token"], r["h2d_MiB_per_token"], r["exposed_ms_per_token"],
                  opt(r["prefetch_accuracy"], ".1%")] for r in rows])
    by_config: dict[str, list[dict]] = {}
    for r in rows:
        by_config.setdefault(r["config"], []).append(r)
    median = {k: statistics.median(r["tpot_ms"] for r in v) for k, v in by_config.items()}
    # the model is deterministic (the same hits in every repeat): it is judged against each config's median
    errors = {k: v[0]["modeled_tpot_ms"] / median[k] - 1 for k, v in by_config.items() if "modeled_tpot_ms" in v[0]}
    repeats = max(len(v) for v in by_config.values())
    if repeats > 1:
        print_table(["config", "runs", "median TPOT ms", "min", "max", "modeled ms", "model err"],
                    [[k, len(v), median[k], min(r["tpot_ms"] for r in v), max(r["tpot_ms"] for r in v),
                      opt(v[0].get("modeled_tpot_ms"), ".1f"), opt(errors.get(k), "+.1%")]
                     for k, v in by_config.items()])
        first = next((median[k] for k in by_config if not k.startswith("100%")), None)
        print("median TPOT over the repeats against the first paged configuration's: " + ", ".join(
            f"{k} {first / median[k]:.3f}x" for k in by_config if not k.startswith("100%")))
    if near:
        print_table(["config", "runs", "vs neighbouring baseline runs: median", "min", "max"],
                    [[k, len(v), statistics.median(v), min(v), max(v)] for k, v in near.items()])
    worst = max(errors.values(), key=abs, default=None)
    if worst is not None:
        print(f"calibrated model vs measured TPOT{' (medians over the repeats)' if repeats > 1 else ''}: worst "
              f"{worst:+.1%} ({'within' if abs(worst) <= TOLERANCE else 'OUTSIDE'} +-{TOLERANCE:.0%}), median "
              f"{statistics.median(abs(e) for e in errors.values()):.1%} over {len(errors)} configurations")
    own = [r for r in rows if "model_own_disk_error" in r]
    if own:
        print("the same model with each configuration's own effective disk rate (the store's bytes / disk-busy time "
              "in that run, latency included) in place of the calibrated link: " + ", ".join(
                  f"{r['config']} {r['disk_GBps_in_run']:.2f} GB/s {r['model_own_disk_error']:+.1%}" for r in own))
    print()
    if ttft:
        print_table(["budget", f"TTFT ms ({args.ttft_prompt}-token prompt, 2nd run)", "modeled ms", "model err",
                     "1st (cold) run ms", "prefill hits", "prefill disk GB/s"],
                    [[t["budget"], t["ttft_ms"], t["modeled_ttft_ms"], f"{t['model_error']:+.1%}",
                      opt(t.get("cold_ttft_ms"), ".0f"), opt(t.get("prefill_hit_rate"), ".1%"),
                      opt(t.get("prefill_disk_GBps") or None, ".2f")] for t in ttft])


def plot(rows: list[dict], out: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines: dict[str, list[dict]] = {}
    resident = [r for r in rows if r["per_layer"] is None]
    for r in rows:
        if r["per_layer"] is not None:
            lines.setdefault(f"{r['policy']} + {r['predictor']}", []).append(r)
    for label, rs in lines.items():
        rs = sorted(rs + resident, key=lambda r: -(r["per_layer"] or 64))
        x = [100 * (r["per_layer"] or 64) / 64 for r in rs]
        ax_t.plot(x, [r["tpot_ms"] for r in rs], marker="o", label=label)
        ax_h.plot(x, [100 * r["hit_rate"] for r in rs], marker="o", label=label)
    modeled_lru = sorted([r for r in rows if r.get("modeled_tpot_ms") and r["policy"] == "lru"],
                         key=lambda r: -(r["per_layer"] or 64))
    ax_t.plot([100 * (r["per_layer"] or 64) / 64 for r in modeled_lru], [r["modeled_tpot_ms"] for r in modeled_lru],
              "k--", label="lru, calibrated model")
    for ax, name in ((ax_t, "decode TPOT (ms)"), (ax_h, "decode expert hit rate (%)")):
        ax.set_xlabel("expert budget (% of all experts)")
        ax.set_ylabel(name)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
