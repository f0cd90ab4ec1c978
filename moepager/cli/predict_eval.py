"""`moepager predict-eval`: recall@k and precision@k of routing predictors per layer, on held-out requests
of a trace (split by request; fitted predictors learn on the rest)."""

from __future__ import annotations

import argparse
import json

from tqdm import tqdm

from moepager.cli.predictor import parse_ints
from moepager.predictors import PREDICTORS, ExpertMapPredictor, Predictor, PredictorError, make_predictor
from moepager.trace.format import TraceReader
from moepager.trace.predict import (
    PredictEval,
    evaluate,
    fit_expert_maps,
    fit_token_wise,
    fit_transition,
    format_eval,
    split_requests,
)

HELP = "measure routing predictors on held-out requests of a trace (recall@k, precision@k per layer)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace file (moepager format)")
    p.add_argument("--predictor", required=True, help=f"comma-separated, from {', '.join(PREDICTORS)}")
    p.add_argument("--distance", default="1", help="prefetch distances in MoE layers, e.g. 1,2,3 (default 1)")
    p.add_argument("--k", help="cut-offs for recall@k (default: top-k and twice top-k)")
    p.add_argument("--test-fraction", type=float, default=0.3, help="held-out share of requests (default 0.3)")
    p.add_argument("--seed", type=int, default=0, help="split seed")
    p.add_argument("--model", help="gate-lookahead: the checkpoint whose routers to apply (the trace's model)")
    p.add_argument("--per-layer", action="store_true", help="also print recall@top-k per layer")
    p.add_argument("--json", metavar="PATH", help="write every result (with per-layer figures) as JSON")


def build(name: str, reader: TraceReader, train: list[int], distances: list[int], model: str | None) -> Predictor:
    h = reader.header
    if name == "transition":
        return fit_transition(reader, train, distances)
    if name == "expert-map":
        return ExpertMapPredictor(fit_expert_maps(reader, train))
    if name == "token-wise":
        return fit_token_wise(reader, train)
    if name == "gate-lookahead":
        if model is None:
            raise PredictorError("gate-lookahead needs --model (the checkpoint the trace was recorded from)")
        from moepager.models.load import load_model
        from moepager.runtime.prefetch import router_scores

        routers = router_scores(load_model(model, show_progress=False).model)
        return make_predictor(name, num_layers=h.num_layers, num_experts=h.num_experts, routers=routers)
    raise PredictorError(f"unknown predictor '{name}'; choose from {', '.join(PREDICTORS)}")


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.predictor.split(",") if n.strip()]
    distances = parse_ints(args.distance, "--distance")
    results: list[PredictEval] = []
    with TraceReader(args.trace) as reader:
        h = reader.header
        ks = parse_ints(args.k, "--k") if args.k else [h.top_k, 2 * h.top_k]
        train, test = split_requests(len(reader), args.test_fraction, args.seed)
        print(f"{h.model}: {len(train)} requests to fit on, {len(test)} held out; top-{h.top_k} of {h.num_experts}")
        for name in names:
            predictor = build(name, reader, train, distances, args.model)
            for d in distances:
                with tqdm(total=len(test), unit="request", desc=f"{name} d={d}", leave=False) as bar:
                    results.append(evaluate(predictor, reader, test, d, ks, progress=bar.update))
    print(format_eval(results))
    if args.per_layer:
        for r in results:
            per_layer = " ".join(f"{r.recall(h.top_k, t) or 0:.2f}" for t in r.tallies)
            print(f"{r.predictor} d={r.distance} recall@{h.top_k} per layer: {per_layer}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_json() for r in results], f, indent=2)
    return 0
