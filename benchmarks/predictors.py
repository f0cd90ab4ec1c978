"""How well does each routing predictor forecast the experts a layer will choose, d MoE layers ahead?

Offline, split by request (seeded, 70% fit / 30% held out, as fMoE splits its prompts):
- DeepSeek-V2-Lite (../shared/traces/deepseek-v2-lite, 2,099 prompts, top-6 of 64, ids only: the expert maps
  use K-hot distributions) and Mixtral-8x7B (the *_2 decode traces, top-2 of 8, renormalised top-2 weights):
  transition tables and fMoE expert maps (semantic stand-in: hashed token strings);
- the built-in demo model (top-4 of 32, 6 layers), traces recorded by the engine with full gates and hidden
  states on its training documents (fit) and validation documents (evaluate): transition, expert maps,
  gate lookahead (the model's own routers) and the token-wise predictor (trained here on the training trace;
  it forecasts one token ahead, so it is also measured at distance L = 6).
Distances 1, 2, 3; recall@K and recall@2K (K = top-k); for expert maps also the size and recall of fMoE's
similarity-selected sets. Usage: python benchmarks/predictors.py [--quick]
(writes results/predictors.json and results/predictors.png)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import (
    RESULTS,
    SHARED,
    converted,
    demo_documents,
    machine_state,
    record_demo_trace,
    write_json,
)
from moepager.checkpoints.default import default_model_path
from moepager.predictors import make_predictor
from moepager.runtime.builder import load_model
from moepager.runtime.prefetch import router_scores
from moepager.trace.fit import FITTERS
from moepager.trace.format import TraceReader
from moepager.trace.predict import (
    PredictEval,
    evaluate,
    format_eval,
    split_requests,
)

DISTANCES = [1, 2, 3]


def row(trace: str, result: PredictEval, k: int, fit_s: float) -> dict:
    sel = result.selected()
    return {"trace": trace, "predictor": result.predictor, "distance": result.distance, "top_k": k,
            "recall@K": result.recall(k), "recall@2K": result.recall(2 * k), "coverage": result.coverage(),
            "fit_s": fit_s,
            "selected_size": sel[0] if sel else None, "selected_recall": sel[1] if sel else None,
            "per_layer_recall@K": [result.recall(k, t) for t in result.tallies], "tokens": result.tokens}


def public_trace(name: str, path: Path, quick: bool) -> list[dict]:
    rows = []
    with TraceReader(path) as reader:
        k = reader.header.top_k
        train, test = split_requests(len(reader), 0.3, seed=0)
        if quick:
            train, test = train[:300], test[:100]
        print(f"{name}: fit on {len(train)} requests, evaluate on {len(test)}")
        fitted = []
        for kind in ("transition", "expert-map"):
            t0 = time.perf_counter()
            options = FITTERS[kind].applicable(distances=tuple(DISTANCES), max_iterations=5000 if quick else 20_000)
            fitted.append((FITTERS[kind].fit(reader, train, options, lambda advance: None), time.perf_counter() - t0))
        results = []
        for predictor, fit_s in fitted:
            for d in DISTANCES:
                results.append(evaluate(predictor, reader, test, d, [k, 2 * k]))
                rows.append(row(name, results[-1], k, fit_s))
        print(format_eval(results), end="\n\n")
    return rows


def demo(quick: bool) -> list[dict]:
    train_docs, valid_docs = demo_documents()
    tokens = 128
    train_docs = train_docs[:: 8 if quick else 3]
    traces = RESULTS / "traces"
    train_path = record_demo_trace(traces / f"demo-moe-train-{len(train_docs)}-{tokens}.mpt", train_docs, tokens,
                                   hidden=True)
    valid_path = record_demo_trace(traces / f"demo-moe-valid-{tokens}.mpt", valid_docs, tokens, hidden=True)
    rows = []
    with TraceReader(train_path) as train, TraceReader(valid_path) as valid:
        h = valid.header
        k, everything = h.top_k, list(range(len(train)))
        fitted = []
        for name, fitter in FITTERS.items():
            t0 = time.perf_counter()
            options = fitter.applicable(distances=tuple(DISTANCES + [h.num_layers]),
                                        epochs=300 if name == "token-wise" else None)
            fitted.append((fitter.fit(train, everything, options, lambda advance: None), time.perf_counter() - t0))
            print(f"fitted {name} on {len(everything)} training documents in {fitted[-1][1]:.1f} s")
        routers = router_scores(load_model(default_model_path(), show_progress=False).model)
        fitted.append((make_predictor("gate-lookahead", num_layers=h.num_layers, num_experts=h.num_experts,
                                      routers=routers), 0.0))
        results = []
        for predictor, fit_s in fitted:
            for d in DISTANCES + [h.num_layers]:
                results.append(evaluate(predictor, valid, range(len(valid)), d, [k, 2 * k]))
                rows.append(row("demo-moe", results[-1], k, fit_s))
        print(f"demo-moe: validation documents, {tokens} tokens each")
        print(format_eval(results), end="\n\n")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        for name in dict.fromkeys(r["predictor"] for r in rows if r["trace"] == trace):
            pts = [(r["distance"], r["recall@K"]) for r in rows if r["trace"] == trace and r["predictor"] == name
                   and r["recall@K"] is not None]
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(title=f"{trace}: recall@top-k", xlabel="prefetch distance (MoE layers)", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="subsets of every trace (a smoke run)")
    ap.add_argument("--only", choices=["public", "demo"], help="only the public traces, or only the demo model")
    args = ap.parse_args()
    state = machine_state()
    rows = []
    if args.only != "demo":
        ds = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
        mx = converted("mixtral-jsonl", SHARED / "mixtral-8x7b" / "routing_data_collected", "mixtral-8x7b")
        rows += public_trace("deepseek-v2-lite", ds, args.quick) + public_trace("mixtral-8x7b", mx, args.quick)
    if args.only != "public":
        rows += demo(args.quick)
    print("| trace | predictor | d | recall@K | recall@2K | fMoE set size / recall |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        sel = f"{r['selected_size']:.1f} / {100 * r['selected_recall']:.1f}%" if r["selected_size"] else "-"
        rec = [f"{100 * r[k]:.1f}%" if r[k] is not None else "-" for k in ("recall@K", "recall@2K")]
        print(f"| {r['trace']} | {r['predictor']} | {r['distance']} | {rec[0]} | {rec[1]} | {sel} |")
    png = RESULTS / ("predictors" + (f"_{args.only}" if args.only else "") + ".png")
    plot(rows, png)
    path = write_json("predictors" + (f"_{args.only}" if args.only else ""),
                      {"machine": state, "rows": rows, "quick": args.quick})
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
