"""Does prefetch lower TPOT when experts stream from disk? Every predictor side by side on the CPU.

Two models: the built-in demo model (trained; 98 KiB experts, so compute-bound) and a random-weight
OLMoE-1B-7B with 4 layers (`make-model --preset olmoe-1b-7b --layers 4`, 12 MiB experts, top-8 of 64: disk-bound).
Expert cache at 25% and 50% of all experts; misses are read from the checkpoint on disk (O_DIRECT where the
file system allows). For each budget: no prefetch, gate lookahead (distance 1), transition tables (distance 1),
fMoE expert maps (distance 3), the token-wise predictor (one token ahead), the head and the path predictor
(each at its own default distance); the fitted ones learn from a trace the engine recorded from the same model
on the demo model's training documents. Prompts: validation
documents cut to 64 tokens, greedy, batch 1. Configurations of one (model, budget) run in interleaved rounds
(every configuration once per round) and the median over rounds is reported, so drift on this noisy machine
hits all of them alike. Reported per configuration: TPOT (median), decode hit rate,
exposed and hidden load time per token, prefetch accuracy and wasted bytes per token, the prefetcher's time on the
forward thread per token (its predictor's matching and queueing, which the forward waits for: fMoE's matcher runs
inline here), and TPOT relative to no prefetch at the same budget (a predictor that does not lower TPOT is reported as
such).
With `--smoe`, SMoE's prefetch selections over gate lookahead instead (`SMOE`: Adaptive-N, Fixed-N, each with and
without Flex; nothing fitted).
Usage: python benchmarks/prefetch_cpu.py [--models demo-moe,olmoe-1b-7b-L4] [--rounds 3] [--threads 2] [--quick]
[--smoe] (writes results/prefetch_cpu.json and .png; with a subset of --models, results/prefetch_cpu_<models>.*,
with --smoe ..._smoe.*)
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tqdm import tqdm

from benchmarks.common import (
    RESULTS,
    demo_documents,
    ensure_model,
    machine_state,
    record_demo_trace,
    write_json,
)
from moepager.config import PrefetchConfig, StoreConfig
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.trace.fit import FITTERS
from moepager.trace.format import TraceReader

PREDICTORS = [None, "gate-lookahead", *FITTERS]
"""No prefetch, gate lookahead (it reads the model's routers) and every fitted predictor."""
SMOE = {"none": {}, "Adaptive-N": {"fixed": False}, "Fixed-N": {"fixed": True}, "Adaptive-N + Flex": {"flex": True},
        "Fixed-N + Flex": {"fixed": True, "flex": True}}
"""`--smoe`: SMoE's prefetch selections (§2.7-2.8) over gate lookahead: Adaptive-N (a row's top-k, loading those not
cached: the default), Fixed-N (exactly k not yet cached), each with and without Flex (prefetch off on the least
accurate half of the layers after 32 passes)."""
BUDGETS = ["25%", "50%"]
MODELS = {"demo-moe": (None, 3), "olmoe-1b-7b-L4": (("olmoe-1b-7b", 4), 24)}
"""name -> (make-model preset and layers, or None for the built-in model; every n-th training document)."""


def model_path(name: str) -> Path | None:
    made = MODELS[name][0]
    return None if made is None else ensure_model(name, made[0], made[1])


def fitted_files(name: str) -> dict[str, Path]:
    """Predictor files fitted on a trace of `name` over training documents (cached under results/predictors/)."""
    out = RESULTS / "predictors"
    files = {kind: out / f"{name}-{kind}.pt" for kind in FITTERS}
    if all(p.exists() for p in files.values()):
        return files
    train_docs = demo_documents()[0][:: MODELS[name][1]]
    trace = record_demo_trace(RESULTS / "traces" / f"{name}-train-{len(train_docs)}-128.mpt", train_docs, 128,
                              hidden=True, model=model_path(name))
    out.mkdir(parents=True, exist_ok=True)
    with TraceReader(trace) as reader:
        everything = list(range(len(reader)))
        for kind, fitter in FITTERS.items():
            if not files[kind].exists():
                options = fitter.applicable(epochs=300 if kind == "token-wise" else None)
                fitter.fit(reader, everything, options, lambda advance: None).save(files[kind])
    return files


def run_once(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    tpot, decode, inline = [], [], 0.0
    for prompt in prompts:
        llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        stats = llm.last_stats
        tpot.append(statistics.median(stats.tpot_s))
        decode.append(stats.sections["experts"].phases["decode"])
        if "prefetch" in stats.sections:  # the prefetcher's time on the forward thread
            inline += stats.sections["prefetch"].to_dict()["inline_s"]["decode"]
    tokens = sum(d["tokens"] for d in decode)
    total = {k: sum(d[k] for d in decode) for k in ("exposed_s", "hidden_s", "prefetch_used", "prefetch_wasted",
                                                     "prefetch_wasted_bytes", "accesses", "loads_ahead")}
    hits = sum(d["hit_rate"] * d["accesses"] for d in decode)
    return {"tpot_s": statistics.median(tpot), "hit_rate": hits / max(1, total["accesses"]),
            "exposed_ms_per_token": 1e3 * total["exposed_s"] / tokens,
            "hidden_ms_per_token": 1e3 * total["hidden_s"] / tokens,
            "prefetch_accuracy": total["prefetch_used"] / max(1, total["prefetch_used"] + total["prefetch_wasted"]),
            "prefetches_per_token": total["loads_ahead"] / tokens,
            "inline_ms_per_token": 1e3 * inline / tokens,
            "wasted_kib_per_token": total["prefetch_wasted_bytes"] / tokens / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="1 round, 2 prompts, 16 tokens (a smoke run)")
    ap.add_argument("--smoe", action="store_true",
                    help="SMoE's selections instead of the predictors: gate lookahead with Adaptive-N, Fixed-N and "
                         "each with Flex (nothing fitted)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.prompts, args.max_tokens = 1, 2, 16
    state = machine_state()
    rows = []
    for name in args.models.split(","):
        rows += measure(name, args)
    print("| model | budget | predictor | TPOT ms | vs none | hit rate | exposed ms/tok | hidden ms/tok | accuracy | "
          "prefetch/tok | wasted KiB/tok | inline ms/tok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['budget']} | {r['predictor']} | {1e3 * r['tpot_s']:.2f} | "
              f"{r['tpot_vs_none']:.2f}x | {100 * r['hit_rate']:.1f}% | {r['exposed_ms_per_token']:.2f} | "
              f"{r['hidden_ms_per_token']:.2f} | "
              f"{100 * r['prefetch_accuracy']:.0f}% | {r['prefetches_per_token']:.1f} | "
              f"{r['wasted_kib_per_token']:.0f} | {r['inline_ms_per_token']:.2f} |")
    for r in rows:
        if r["predictor"] != "none" and not r["lowers_tpot"]:
            print(f"note: {r['model']} {r['predictor']} at {r['budget']} does not lower TPOT "
                  f"({r['tpot_vs_none']:.2f}x of none)")
    name = "prefetch_cpu" if args.models == ",".join(MODELS) else "prefetch_cpu_" + args.models.replace(",", "_")
    name += "_smoe" if args.smoe else ""
    png = RESULTS / f"{name}.png"
    plot(rows, png)
    path = write_json(name, {"machine": state, "threads": args.threads, "rounds": args.rounds,
                                       "prompts": args.prompts, "max_tokens": args.max_tokens, "rows": rows})
    print(f"wrote {path} and {png}")


def configurations(name: str, smoe: bool) -> dict[str, PrefetchConfig]:
    """label -> the prefetch of one engine: every predictor, or (`--smoe`) SMoE's selections over gate lookahead."""
    if smoe:
        return {label: PrefetchConfig("gate-lookahead", **o) if o else PrefetchConfig() for label, o in SMOE.items()}
    files = fitted_files(name)
    return {p or "none": PrefetchConfig(p, file=str(files[p]) if p in files else None) for p in PREDICTORS}


def measure(name: str, args: argparse.Namespace) -> list[dict]:
    """Every configuration at every budget on one model; one (model, budget) group of engines alive at a time."""
    configs, path = configurations(name, args.smoe), model_path(name)
    rows = []
    for budget in BUDGETS:
        llms = {}
        store = StoreConfig(expert_memory=budget, policy="lru", direct_io="auto")
        for label, prefetch in configs.items():
            llms[label] = LLM(path, store=store, prefetch=prefetch, threads=args.threads, show_progress=False)
        prompts = [llms["none"].encode(doc)[:64] for doc in demo_documents()[1][: args.prompts]]
        samples: dict[str, list[dict]] = {label: [] for label in configs}
        with tqdm(total=args.rounds * len(configs), desc=f"{name} {budget}", unit="run") as bar:
            for _ in range(args.rounds):
                for label in configs:
                    samples[label].append(run_once(llms[label], prompts, args.max_tokens))
                    bar.update(1)
        del llms
        group = [{"model": name, "budget": budget, "predictor": label,
                  **{k: statistics.median(run[k] for run in samples[label]) for k in samples[label][0]}}
                 for label in configs]
        for r in group:
            r["tpot_vs_none"] = r["tpot_s"] / group[0]["tpot_s"]
            r["lowers_tpot"] = r["tpot_vs_none"] < 0.97
        rows += group
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    names = list(dict.fromkeys(r["predictor"] for r in rows))
    width = 0.8 / len(BUDGETS)
    for m, model in enumerate(models):
        for b, budget in enumerate(BUDGETS):
            sel = [next(r for r in rows if r["model"] == model and r["budget"] == budget and r["predictor"] == n)
                   for n in names]
            xs = [i + b * width for i in range(len(names))]
            axes[m][0].bar(xs, [1e3 * r["tpot_s"] for r in sel], width, label=f"cache {budget}")
            axes[m][1].bar(xs, [r["exposed_ms_per_token"] for r in sel], width, label=f"cache {budget}")
        for ax, title in zip(axes[m], ("TPOT (ms)", "exposed expert load time (ms / token)")):
            ax.set_xticks([i + width * (len(BUDGETS) - 1) / 2 for i in range(len(names))], names, rotation=20)
            ax.set_title(f"{model}: {title}")
            ax.legend()
            ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
