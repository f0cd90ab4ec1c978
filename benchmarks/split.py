"""MoEpic's split experts and cache configurator: do they lower decode TPOT and bytes moved against the even split?

Configurations, each at every `--budgets` share of the experts, LRFU (the engine's default) unless said:
- `unsplit, even`: whole experts, every layer the same share of the cache (the baseline);
- `unsplit, configured`: whole experts, per-layer budgets from the configurator (`moepager plan --whole-experts`);
- `split 4, configured`: a `moepager split --parts 4` checkpoint, per-layer budgets and split ratios from the
  configurator (`moepager plan --parts 4`; on these traces it keeps θ = 1 wherever a split would move more bytes);
- `split 4, θ 0.5`: the same checkpoint, every layer caching the top halves of twice the experts (MoEpic's split
  forced: hits still read their bottom half);
- `split 4, online`: the split checkpoint under `--configure auto` (the configurator online, every `--every` tokens);
- `unsplit, even, prefetch` and `split 4, θ 0.5, prefetch`: the baseline and the forced split with prefetch (MoEpic's
  speculative prefetch: the next layer's forecast experts, on the split checkpoint the tops into the cache and the
  bottoms into the free stream rows), forecasts by the workload's predictor: on the replay the co-occurrence table
  (`transition`) fitted on the trace's first `--fit` requests, on the built-in model its next layer's gate
  (`gate-lookahead`). Bytes moved count the loads ahead: a prefetch hides a load, it does not save it.
Plans are fitted on the trace's first requests (hit curves), never on the measured ones; costs: `--profile`.

Workloads:
- `replay` (the default when the trace is there): the DeepSeek-V2-Lite geometry with `--layers` MoE layers (random
  weights, real geometry: 64 experts of 16.5 MiB, top-6) on the CPU, experts read from disk with O_DIRECT, replaying
  the DeepSeek-V2-Lite trace's real routing (`--requests` held-out requests, a `--prompt`-token prompt and `--decode`
  steps each). `--rounds` rounds, every configuration once per round in turn, so each is paired with a neighbouring
  baseline run: ratios are per round, then the median.
- `built-in`: the built-in model generating greedy text from validation documents (its own routing; plans fitted on
  its recording of training documents).
- `simulated` (no model): bytes per token judged on held-out requests of the DeepSeek-V2-Lite and Mixtral traces and
  the built-in model's recording at 12.5/25/50% (`moepager plan`'s judge: per-layer LRU caches, split runs part for
  part, trace/split.py).
Writes results/split.json and results/split.png.

    python -m benchmarks.split [--workloads replay built-in simulated] [--budgets 25% 12.5%] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    RESULTS,
    SHARED,
    demo_documents,
    ensure_model,
    measured_workloads,
    print_table,
    write_json,
)
from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.split import split_checkpoint
from moepager.cli.plan import judge
from moepager.config import Budget, EngineConfig, PrefetchConfig, StoreConfig
from moepager.planning.configurator import layer_costs, vram_allocation
from moepager.planning.configurator import statistics as hit_statistics
from moepager.planning.cost import CostModel
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec
from moepager.runtime.sampling import SamplingParams
from moepager.trace.format import TraceReader
from moepager.trace.workload import load_workload

PARTS = 4
CONFIGS = ("unsplit, even", "unsplit, configured", "split 4, configured", "split 4, θ 0.5", "split 4, online",
           "unsplit, even, prefetch", "split 4, θ 0.5, prefetch")
PREFETCH = ", prefetch"


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["replay", "built-in", "simulated"],
                   choices=["replay", "built-in", "simulated"])
    p.add_argument("--budgets", nargs="+", default=["25%", "12.5%"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--layers", type=int, default=2, help="replay: MoE layers of the DeepSeek-V2-Lite geometry")
    p.add_argument("--requests", type=int, default=3, help="replay: held-out requests; built-in: prompts")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--decode", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--every", type=int, default=24, help="--configure-every of the online configuration")
    p.add_argument("--fit", type=int, default=1500, help="replay: requests of the trace the plans are fitted on")
    p.add_argument("--profile", default="cpu-disk", help="the configurator's costs (a profile name or JSON)")
    p.add_argument("--threads", type=int, default=None)
    return p


# -- plans ------------------------------------------------------------------------------------------------------------
def plans(trace: Path, fit: slice, budgets: list[str], profile: str, out: Path) -> dict[str, dict[str, Path | None]]:
    """Per budget, the layer plans of the configurations, fitted on requests `fit` of `trace` (hit curves measured
    once; JSON files in `out`)."""
    work = load_workload(str(trace), "decode", 1, fit)
    h = work.header
    hit_LC = hit_statistics(work.ids_NLK[work.step_tokens], None, h.num_experts)[0]
    costs = layer_costs(CostModel.profile(profile, h.expert_bytes), h.num_layers)
    out.mkdir(parents=True, exist_ok=True)
    every: dict[str, dict[str, Path | None]] = {}
    for budget in budgets:
        total = Budget.parse(budget, "--budgets").fraction * h.num_layers * h.num_experts  # type: ignore[operator]
        files = every[budget] = {"unsplit, even": None, "split 4, online": None}
        for label, kwargs in (("unsplit, configured", {"split": False}), ("split 4, configured", {"parts": PARTS}),
                              ("split 4, θ 0.5", {"parts": PARTS, "theta": 0.5})):
            if label == "split 4, θ 0.5":
                budgets_L, theta = np.full(h.num_layers, total / h.num_layers), np.full(h.num_layers, 0.5)
            else:
                plan = vram_allocation(total, hit_LC, h.top_k, costs, **kwargs)  # type: ignore[arg-type]
                budgets_L, theta = plan.budgets_L, plan.theta_L
            name = f"{trace.stem}-{budget.rstrip('%')}-{label.replace(' ', '_').replace(',', '')}.json"
            path = files[label] = out / name
            path.write_text(json.dumps({"budgets": budgets_L.tolist(), "theta": theta.tolist()}))
        files["unsplit, even" + PREFETCH], files["split 4, θ 0.5" + PREFETCH] = None, files["split 4, θ 0.5"]
    return every


# -- measured ---------------------------------------------------------------------------------------------------------
def engine(path: Path, split: Path, label: str, budget: str, plan: Path | None, prefetch: PrefetchConfig,
           args: argparse.Namespace) -> LLM:
    online = label == "split 4, online"
    store = StoreConfig(expert_memory=budget, layer_plan=str(plan) if plan else None,
                        configure="auto" if online else "off", configure_every=args.every)
    return LLM(config=EngineConfig(model=str(split if label.startswith("split") else path), threads=args.threads,
                                   store=store, prefetch=prefetch if label.endswith(PREFETCH) else PrefetchConfig()),
               show_progress=False)


def figures(llm: LLM) -> dict[str, Any]:
    s = llm.last_stats
    decode = s.sections["experts"].to_dict().get("decode", {})
    decoded = s.generated_tokens - s.num_prompts
    return {"tpot_ms": 1e3 * s.decode_s / max(decoded, 1), "decoded": decoded,
            "MiB_per_token": decode.get("bytes_disk_per_token", 0) / 2**20,
            "exposed_ms_per_token": 1e3 * decode.get("exposed_s", 0.0) / max(decoded, 1),
            "hit_rate": decode.get("hit_rate"), "loads_ahead_per_token": decode.get("loads_ahead", 0) / max(decoded, 1),
            "prefetch_used_per_token": decode.get("prefetch_used", 0) / max(decoded, 1)}


def close(llm: LLM) -> None:
    if llm.store is not None:
        llm.store.close()
    del llm
    gc.collect()


def measured(workload: str, path: Path, split: Path, trace: Path, fit: slice, run, prefetch: PrefetchConfig,
             args: argparse.Namespace) -> list[dict]:
    """Every configuration at every budget, `args.rounds` interleaved rounds; `run(llm)` makes one measurement;
    `prefetch`: the configurations with prefetch."""
    rows, every = [], plans(trace, fit, args.budgets, args.profile, RESULTS / "split")
    for budget in args.budgets:
        files = every[budget]
        samples: dict[str, list[dict]] = {label: [] for label in args.configs}
        for r in range(args.rounds):
            for label in args.configs:
                llm = engine(path, split, label, budget, files[label], prefetch, args)
                tokens = run(llm)
                sample = figures(llm) | {"tokens": tokens}
                if llm.configurator is not None:
                    sample["reconfigurations"] = len(llm.configurator.changes)
                samples[label].append(sample)
                close(llm)
                print(f"{workload} {budget} round {r + 1}: {label}: {sample['tpot_ms']:.1f} ms, "
                      f"{sample['MiB_per_token']:.1f} MiB/token", flush=True)
        base = samples[args.configs[0]]
        for label in args.configs:
            runs = samples[label]
            plan = files[label]
            rows.append({"workload": workload, "budget": budget, "config": label,
                         **{k: statistics.median(run[k] for run in runs)
                            for k in ("tpot_ms", "MiB_per_token", "exposed_ms_per_token", "hit_rate",
                                      "loads_ahead_per_token", "prefetch_used_per_token")},
                         "tpot_ratio": statistics.median(a["tpot_ms"] / b["tpot_ms"] for a, b in zip(runs, base)),
                         "bytes_ratio": statistics.median(a["MiB_per_token"] / max(b["MiB_per_token"], 1e-9)
                                                          for a, b in zip(runs, base)),
                         "same_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(runs, base)),
                         "plan": json.loads(plan.read_text()) if plan else None,
                         "reconfigurations": runs[-1].get("reconfigurations")})
    return rows


def replayed(args: argparse.Namespace) -> list[dict]:
    from benchmarks.offload_replay import deepseek_trace, fitted_predictors, replayed_requests

    path = ensure_model(f"deepseek-v2-lite-L{args.layers + 1}", "deepseek-v2-lite", args.layers + 1)
    split = split_copy(path)
    trace = deepseek_trace(args.layers)
    requests = replayed_requests(trace, args.fit, args.requests, args.prompt + args.decode)
    spec = ReplaySpec(trace, requests, args.prompt, "match", args.decode)

    def run(llm: LLM) -> list[list[int]]:
        return [c.token_ids for c in llm.replay(spec)]

    prefetch = PrefetchConfig()
    if any(label.endswith(PREFETCH) for label in args.configs):
        table = fitted_predictors(trace, list(range(args.fit)), {("transition", "plain")})[("transition", "plain")]
        prefetch = PrefetchConfig("transition", file=str(table))
    return measured("replay", path, split, trace, slice(0, args.fit), run, prefetch, args)


def built_in(args: argparse.Namespace) -> list[dict]:
    from benchmarks.common import record_demo_trace

    path = default_model_path()
    split = split_copy(path, RESULTS / "models" / f"demo-moe-split{PARTS}")
    train, valid = demo_documents()
    trace = record_demo_trace(RESULTS / "traces" / "demo-hybrid.mpt", train[:48], 64, max_new=24)
    prompts = [doc[:120] for doc in valid[: args.requests]]
    params = SamplingParams(max_tokens=args.decode + 1, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        return [c.token_ids for c in llm.generate(prompts, params)]

    with TraceReader(trace) as reader:
        fit = slice(0, len(reader))
    return measured("built-in", Path(path), split, trace, fit, run, PrefetchConfig("gate-lookahead"), args)


def split_copy(path: Path, out: Path | None = None) -> Path:
    """`moepager split --parts 4` of a checkpoint, made once beside it under results/models/."""
    out = out or path.with_name(f"{path.name}-split{PARTS}")
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        split_checkpoint(path, out, PARTS, force=True)
    return out


# -- simulated --------------------------------------------------------------------------------------------------------
def simulated(args: argparse.Namespace) -> list[dict]:
    from benchmarks.common import converted, record_demo_trace

    traces: dict[str, Path] = {}
    if (SHARED / "deepseek-v2-lite").exists() or (RESULTS / "traces" / "deepseek-v2-lite.mpt").exists():
        traces["deepseek-v2-lite"] = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
    if (SHARED / "mixtral-8x7b").exists() or (RESULTS / "traces" / "mixtral-8x7b.mpt").exists():
        traces["mixtral-8x7b"] = converted("mixtral-jsonl", SHARED / "mixtral-8x7b" / "routing_data_collected",
                                           "mixtral-8x7b")
    traces["built-in"] = record_demo_trace(RESULTS / "traces" / "demo-hybrid.mpt", demo_documents()[0][:48], 64,
                                           max_new=24)
    rows = []
    for name, trace in traces.items():
        with TraceReader(trace) as reader:
            count = len(reader)
        cut = max(1, min(count - 1, round(0.7 * count)))
        fit, held_out = slice(0, cut), slice(cut, None)
        fitted = load_workload(str(trace), "decode", 1, fit)
        test = load_workload(str(trace), "decode", 1, held_out)
        h = fitted.header
        hit_LC = hit_statistics(fitted.ids_NLK[fitted.step_tokens], None, h.num_experts)[0]
        costs = layer_costs(CostModel.profile(args.profile, h.expert_bytes), h.num_layers)
        for share in (0.125, 0.25, 0.5):
            total = share * h.num_layers * h.num_experts
            if total / h.num_layers < h.top_k:
                continue  # Mixtral at 12.5%: below a token's top-2
            even = np.full(h.num_layers, total / h.num_layers)
            whole = vram_allocation(total, hit_LC, h.top_k, costs, split=False)
            parts = vram_allocation(total, hit_LC, h.top_k, costs, parts=PARTS)
            judged = [judge("unsplit, even", np.floor(even), np.ones(h.num_layers), test, h.expert_bytes),
                      judge("unsplit, configured", whole.cached_L, whole.theta_L, test, h.expert_bytes),
                      judge("split 4, configured", np.floor(parts.cached_L), parts.theta_L, test, h.expert_bytes,
                            PARTS, parts.budgets_L),
                      judge("split 4, θ 0.5", np.floor(even / 0.5), np.full(h.num_layers, 0.5), test, h.expert_bytes,
                            PARTS, even)]
            for row in judged:
                rows.append({"trace": name, "budget": f"{100 * share:g}%", "config": row["label"],
                             "MiB_per_token": row["bytes_per_token"] / 2**20, "hit_rate": row["hit_rate"],
                             "bytes_ratio": row["bytes_per_token"] / judged[0]["bytes_per_token"],
                             "split_layers": int(sum(t < 1 for t in row["theta"]))})
    return rows


def plot(measured_rows: list[dict], simulated_rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("measured TPOT / unsplit even", measured_rows, "tpot_ratio", ("workload", "budget")),
              ("simulated bytes per token / unsplit even", simulated_rows, "bytes_ratio", ("trace", "budget"))]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (title, rows, key, group) in zip(axes[0], panels):
        groups = list(dict.fromkeys((r[group[0]], r[group[1]]) for r in rows))
        configs = list(dict.fromkeys(r["config"] for r in rows))
        width = 0.8 / len(configs)
        for j, config in enumerate(configs):
            values = [next((r[key] for r in rows if (r[group[0]], r[group[1]]) == g and r["config"] == config),
                           np.nan) for g in groups]
            ax.bar(np.arange(len(groups)) + j * width, values, width, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, [f"{a}\n{b}" for a, b in groups], fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    args = arguments().parse_args()
    state, rows = measured_workloads(args, replayed, built_in)
    if rows:
        print("\nmeasured (CPU, experts read from disk; ratios per round against the neighbouring unsplit-even run):")
        print_table(["workload", "budget", "config", "TPOT ms", "x even", "MiB/token", "x even", "exposed ms/tok",
                     "hit %", "ahead/tok", "used/tok", "tokens"],
                    [[r["workload"], r["budget"], r["config"], r["tpot_ms"], r["tpot_ratio"], r["MiB_per_token"],
                      r["bytes_ratio"], r["exposed_ms_per_token"], 100 * (r["hit_rate"] or 0),
                      r["loads_ahead_per_token"], r["prefetch_used_per_token"],
                      "same" if r["same_tokens"] else "DIFFER"] for r in rows])
    sim = simulated(args) if "simulated" in args.workloads else []
    if sim:
        print("\nsimulated (held-out requests, per-layer LRU; split runs part for part):")
        print_table(["trace", "budget", "config", "MiB/token", "x even", "hit %", "split layers"],
                    [[r["trace"], r["budget"], r["config"], r["MiB_per_token"], r["bytes_ratio"], 100 * r["hit_rate"],
                      r["split_layers"]] for r in sim])
    png = RESULTS / "split.png"
    if rows or sim:
        plot(rows, sim, png)
    out = write_json("split", {"machine": state, "args": vars(args), "measured": rows, "simulated": sim})
    print(f"\nresults: {out} and {png}")


if __name__ == "__main__":
    main()
