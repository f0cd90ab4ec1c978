"""Prediction that pays, on real routing: predictors against the co-occurrence baseline, and forecast-driven
caching (ExpertFlow's PLEC) against LRU and Belady.

Traces (fit and test on disjoint requests):
- DeepSeek-V2-Lite (../shared/traces/deepseek-v2-lite: 2,099 prompts, 26 MoE layers, top-6 of 64, token strings),
  split by request 70/30 (seed 0);
- Mixtral-8x7B (../shared/traces/mixtral-8x7b, the *_2 decode traces: 5 requests, 32 layers, top-2 of 8, no
  tokens), split 70/30 (3 requests fit, 2 tested);
- the built-in model's recordings (top-4 of 32, 6 layers, token ids): training documents fit, validation
  documents tested (benchmarks/common.record_demo_trace).
Part 1, predictors: `transition` with one source (the co-occurrence-with-back-off baseline), with three
sources, fMoE's expert maps (the paper's single best map, and 16 neighbours matched by trajectory only), the
learned `head`, ExpertFlow's `path` predictor; recall@4 and recall@K at the whole pass ahead and at distances
1-3.
Part 2, caching with per-layer caches of 12.5% and 25% of the experts (at least top-k), the test requests
replayed one after another in decode order: LRU, LCP, Belady, PLEC on the head's forecasts without prefetch
(eviction by predicted next use only), and PLEC with prefetch of the head's 1 / K most likely experts per layer
at distance 1 (hits are experts resident when their layer routes, as ExpertFlow counts them). Per row: hit
ratio, the share of the LRU->Belady gap it closes, and transfers per token-layer (all loads, demand loads).
Usage: python benchmarks/forecast_cache.py [--quick] [--only deepseek mixtral demo] [--path-shape small|paper|t5]
(writes results/forecast_cache.json and .png)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import RESULTS, SHARED, converted, demo_documents, machine_state, record_demo_trace, write_json
from moepager.trace.fit import FITTERS, ExpertMapFit, HeadFit, PathFit, TransitionFit
from moepager.trace.format import TraceReader
from moepager.trace.predict import (
    PASS,
    distance_label,
    evaluate,
    replay_forecasts,
    split_requests,
)
from moepager.trace.simulate import SimSpec, simulate
from moepager.trace.workload import load_workload

DISTANCES = [PASS, 1, 2, 3]


def traces(only: list[str], quick: bool) -> list[tuple[str, Path, Path, list[int], list[int]]]:
    """(name, fit trace, test trace, fit requests, test requests) per trace."""
    out = []
    for name, fmt, src in (("deepseek-v2-lite", "deepseek-csv", SHARED / "deepseek-v2-lite"),
                           ("mixtral-8x7b", "mixtral-jsonl", SHARED / "mixtral-8x7b" / "routing_data_collected")):
        if name.split("-")[0] not in only:
            continue
        path = converted(fmt, src, name)
        with TraceReader(path) as reader:
            train, test = split_requests(len(reader), 0.3, seed=0)
        if quick:
            train, test = train[:300], test[:100]
        out.append((name, path, path, train, test))
    if "demo" in only:
        train_docs, valid_docs = demo_documents()
        train_docs = train_docs[:: 8 if quick else 3]
        fit = record_demo_trace(RESULTS / "traces" / f"demo-moe-train-{len(train_docs)}-128.mpt", train_docs, 128,
                                hidden=True)
        valid = record_demo_trace(RESULTS / "traces" / "demo-moe-valid-128.mpt", valid_docs, 128, hidden=True)
        with TraceReader(fit) as a, TraceReader(valid) as b:
            out.append(("demo-moe", fit, valid, list(range(len(a))), list(range(len(b)))))
    return out


def predictors(name: str, fit: Path, test: Path, train: list[int], tested: list[int],
               shape: str) -> tuple[list[dict], dict]:
    rows, fitted = [], {}
    with TraceReader(fit) as fr, TraceReader(test) as tr:
        h = tr.header
        k = h.top_k
        ks = sorted({4, k})
        variants = [("transition (co-occurrence + back-off)", "transition", TransitionFit(distances=(1, 2, 3, 4, 5))),
                    ("transition, 3 sources", "transition", TransitionFit(distances=(1, 2, 3, 4, 5), sources=3)),
                    ("expert-map (fMoE: the best map)", "expert-map", ExpertMapFit()),
                    ("expert-map, 16 neighbours, trajectory only", "expert-map",
                     ExpertMapFit(neighbours=16, trajectory_only=True)),
                    ("head", "head", HeadFit(distances=(1, 2, 3, h.num_layers))),
                    (f"path ({shape})", "path", PathFit(shape=shape))]
        for label, kind, options in variants:
            t0 = time.perf_counter()
            try:
                predictor = FITTERS[kind].fit(fr, train, options, lambda advance: None)
            except Exception as e:  # the path predictor needs tokens (Mixtral's trace has none)
                print(f"  {label}: not fitted ({e})")
                continue
            fit_s = time.perf_counter() - t0
            fitted[label] = predictor
            for d in DISTANCES:
                r = evaluate(predictor, tr, tested, d, ks)
                if r.coverage() == 0:
                    continue
                rows.append({"trace": name, "predictor": label, "distance": distance_label(d), "top_k": k,
                             "recall@4": r.recall(4), "recall@K": r.recall(k), "coverage": r.coverage(),
                             "fit_s": fit_s, "tokens": r.tokens})
    base = {r["distance"]: r for r in rows if r["predictor"].startswith("transition (")}
    for r in rows:
        b = base.get(r["distance"])
        r["vs_baseline@4"] = None if b is None else r["recall@4"] - b["recall@4"]
    return rows, fitted


def caching(name: str, test: Path, tested: list[int], head) -> list[dict]:
    with TraceReader(test) as tr:
        h = tr.header
        num_layers, k = h.num_layers, h.top_k
        work = load_workload(str(test), requests=tested)
        replayed = replay_forecasts(head, tr, tested, work.request_N, 1)
    rows = []
    sizes = sorted({max(k, round(h.num_experts * share)) for share in (0.125, 0.25)})
    for size in sizes:
        share = size / h.num_experts
        specs = [("lru", SimSpec("lru", size)), ("lcp", SimSpec("lcp", size)), ("belady", SimSpec("belady", size)),
                 ("plec (head forecasts, no prefetch)", SimSpec("plec", size, forecast="predictor")),
                 ("plec + prefetch 1", SimSpec("plec", size, forecast="predictor", prefetch=1)),
                 (f"plec + prefetch {k}", SimSpec("plec", size, forecast="predictor", prefetch=min(k, size)))]
        hits = {}
        for label, spec in specs:
            result = simulate(work, spec, replayed=replayed)
            per = len(work.ids_NLK) * num_layers
            hits[label] = result.hit_rate()
            rows.append({"trace": name, "experts_per_layer": size, "share": share, "policy": label,
                         "hit_rate": result.hit_rate(), "loads_per_token_layer": result.loads / per,
                         "demand_loads_per_token_layer": float(result.demand_loads_SL.sum()) / per})
        gap = hits["belady"] - hits["lru"]
        for r in rows[-len(specs):]:
            r["gap_closed"] = (r["hit_rate"] - hits["lru"]) / gap if gap > 0 else None
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["trace"], r["experts_per_layer"]) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, (trace, size) in zip(axes[0], keys):
        sel = [r for r in rows if r["trace"] == trace and r["experts_per_layer"] == size]
        ax.bar(range(len(sel)), [r["hit_rate"] for r in sel], color="tab:blue")
        ax.set_xticks(range(len(sel)), [r["policy"].split(" (")[0] for r in sel], rotation=45, ha="right")
        ax.set(title=f"{trace}, {size} experts/layer", ylabel="hit ratio", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="subsets of every trace (a smoke run)")
    traces = ["deepseek", "mixtral", "demo"]
    ap.add_argument("--only", nargs="+", default=traces, choices=traces)
    ap.add_argument("--path-shape", default="small", choices=["small", "paper", "t5"])
    args = ap.parse_args()
    state = machine_state()
    predictor_rows, cache_rows = [], []
    for name, fit, test, train, tested in traces(args.only, args.quick):
        print(f"{name}: fit on {len(train)} requests, test on {len(tested)}", flush=True)
        rows, fitted = predictors(name, fit, test, train, tested, args.path_shape)
        predictor_rows += rows
        for r in rows:
            delta = "" if r["vs_baseline@4"] is None else f"{r['vs_baseline@4']:+.3f}"
            print(f"  {r['predictor']:<40} {r['distance']:>4}  recall@4 {r['recall@4']:.3f} {delta:>7}  "
                  f"recall@{r['top_k']} {r['recall@K']:.3f}", flush=True)
        cache_rows += caching(name, test, tested, fitted["head"])
        for r in cache_rows:
            if r["trace"] == name:
                gap = "-" if r["gap_closed"] is None else f"{r['gap_closed']:+.0%}"
                print(f"  {r['experts_per_layer']:>3} {r['policy']:<36} hit {r['hit_rate']:.3f}  gap {gap:>6}  "
                      f"loads {r['loads_per_token_layer']:.2f}  demand {r['demand_loads_per_token_layer']:.2f}",
                      flush=True)
    print("\n| trace | predictor | distance | recall@4 | vs baseline | recall@K |\n|---|---|---|---|---|---|")
    for r in predictor_rows:
        delta = "-" if r["vs_baseline@4"] is None else f"{r['vs_baseline@4']:+.3f}"
        print(f"| {r['trace']} | {r['predictor']} | {r['distance']} | {r['recall@4']:.3f} | {delta} | "
              f"{r['recall@K']:.3f} (K={r['top_k']}) |")
    print("\n| trace | experts/layer | policy | hit ratio | LRU->Belady gap closed | loads / token-layer | demand |"
          "\n|---|---|---|---|---|---|---|")
    for r in cache_rows:
        gap = "-" if r["gap_closed"] is None else f"{r['gap_closed']:.0%}"
        print(f"| {r['trace']} | {r['experts_per_layer']} ({r['share']:.1%}) | {r['policy']} | {r['hit_rate']:.3f} | "
              f"{gap} | {r['loads_per_token_layer']:.2f} | {r['demand_loads_per_token_layer']:.2f} |")
    name = "forecast_cache_quick" if args.quick else "forecast_cache"
    out = write_json(name, {"machine": state, "args": vars(args), "predictors": predictor_rows, "caching": cache_rows})
    plot(cache_rows, RESULTS / f"{name}.png")
    print(f"wrote {out} and {RESULTS / (name + '.png')}")


if __name__ == "__main__":
    main()
