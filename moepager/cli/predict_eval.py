"""`moepager predict-eval`: recall@k and precision@k of routing predictors per layer, on held-out requests
of a trace (split by request; fitted predictors learn on the rest)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from moepager.atomic_io import atomic_file, check_file
from moepager.cli.predictor import parse_ints
from moepager.predictors import PREDICTORS, Predictor, PredictorError, make_predictor
from moepager.predictors.head import DEFAULT_HIDDEN
from moepager.trace.fit import FITTERS
from moepager.trace.format import TraceReader
from moepager.trace.predict import (
    PASS,
    PredictEval,
    distance_label,
    evaluate,
    format_eval,
    split_requests,
)

HELP = "measure routing predictors on held-out requests of a trace (recall@k, precision@k per layer)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace file (moepager format)")
    p.add_argument("--predictor", required=True, help=f"comma-separated, from {', '.join(PREDICTORS)}")
    p.add_argument("--distance", default="1", help="prefetch distances in MoE layers, e.g. pass,1,2,3 (default 1); "
                   "'pass' forecasts every layer of a token before any of them runs (head, path)")
    p.add_argument("--k", help="cut-offs for recall@k (default: top-k and twice top-k)")
    p.add_argument("--test-fraction", type=float, default=0.3, help="held-out share of requests (default 0.3)")
    p.add_argument("--seed", type=int, default=0, help="split seed")
    p.add_argument("--model", help="gate-lookahead: the checkpoint whose routers to apply (the trace's model)")
    p.add_argument("--per-layer", action="store_true", help="also print recall@top-k per layer")
    p.add_argument("--json", metavar="PATH", help="write every result (with per-layer figures) as JSON")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    p.add_argument("--head-hidden", type=int, metavar="H",
                   help=f"head: fit it with an MLP of H hidden units per layer beside the linear head (0: linear; "
                        f"default: linear or {DEFAULT_HIDDEN}, chosen on held-out training requests)")
    p.add_argument("--no-tokens", action="store_true", help="head: fit it without the token")
    p.add_argument("--prompt", type=int, metavar="N",
                   help="each request's first N tokens are its prompt, the rest generated (as a replay with "
                        "--route-prompt N runs it; what the path predictor's T5 layout encodes); default: the "
                        "recorded phases")


def build(name: str, reader: TraceReader, train: list[int], distances: list[int], model: str | None,
          prompt: int | None = None, head_hidden: int | None = None, tokens: bool = True) -> Predictor:
    """A fitted predictor learns on `train` (FITTERS); gate-lookahead applies the routers of `model`."""
    h = reader.header
    fitter = FITTERS.get(name)
    if fitter is not None:
        options = fitter.applicable(distances=tuple(d for d in distances if d != PASS) or (1,), prompt=prompt,
                                    hidden=head_hidden, tokens=tokens)
        with tqdm(total=fitter.total(train, options), desc=f"fitting {name}", unit=fitter.unit, leave=False) as bar:
            return fitter.fit(reader, train, options, bar.update)
    assert model is not None  # checked up front (check_needs)
    from moepager.runtime.builder import load_model
    from moepager.runtime.prefetch import router_scores

    routers = router_scores(load_model(model, show_progress=False).model)
    return make_predictor(name, num_layers=h.num_layers, num_experts=h.num_experts, routers=routers)


def check_needs(names: list[str], reader: TraceReader, model: str | None) -> None:
    """Every predictor's needs, before any of them is fitted: a known name, hidden states in the trace for
    token-wise, a checkpoint of the trace's geometry for gate-lookahead."""
    for name in names:
        if name not in PREDICTORS:
            raise PredictorError(f"unknown predictor '{name}'; choose from {', '.join(PREDICTORS)}")
        if PREDICTORS[name].replay_only:
            raise PredictorError(f"{name} reads the routing an engine replay runs (`moepager generate --route-from`); "
                                 "on a trace it would score 100% by construction")
    if "token-wise" in names and (not len(reader) or reader.request(0).hidden_TLD is None):
        raise PredictorError(f"token-wise learns from router inputs, which {reader.path} does not hold; record a "
                             f"trace with `generate --record-trace PATH --record-hidden`")
    if any(PREDICTORS[name].needs_routers for name in names):
        if model is None:
            raise PredictorError("gate-lookahead needs --model (the checkpoint the trace was recorded from)")
        from moepager.loading.build import read_config
        from moepager.runtime.replay import check_geometry

        check_geometry(reader.header, read_config(model), "match")


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.predictor.split(",") if n.strip()]
    distances = parse_ints(args.distance, "--distance", {"pass": PASS})
    json_out = check_file(args.json, "--json", args.force, {"--trace": args.trace, "--model": args.model})
    results: list[PredictEval] = []
    with TraceReader(args.trace) as reader:
        h = reader.header
        ks = parse_ints(args.k, "--k") if args.k else [h.top_k, 2 * h.top_k]
        check_needs(names, reader, args.model)
        train, test = split_requests(len(reader), args.test_fraction, args.seed)
        print(f"{h.model}: {len(train)} requests to fit on, {len(test)} held out; top-{h.top_k} of {h.num_experts}")
        try:
            for name in names:
                predictor = build(name, reader, train, distances, args.model, args.prompt, args.head_hidden,
                                  not args.no_tokens)
                for d in distances:
                    with tqdm(total=len(test), unit="request", desc=f"{name} d={d}", leave=False) as bar:
                        results.append(evaluate(predictor, reader, test, d, ks, progress=bar.update,
                                                prompt=args.prompt))
        finally:  # what finished is printed and saved even when a later predictor fails or is interrupted
            _report(results, args.per_layer, h.top_k, json_out)
    return 0


def _report(results: list[PredictEval], per_layer: bool, top_k: int, json_out: Path | None) -> None:
    if not results:
        return
    print(format_eval(results))
    if per_layer:
        for r in results:
            recalls = " ".join(f"{r.recall(top_k, t) or 0:.2f}" for t in r.tallies)
            print(f"{r.predictor} d={distance_label(r.distance)} recall@{top_k} per layer: {recalls}")
    if json_out is not None:
        with atomic_file(json_out) as tmp:
            tmp.write_text(json.dumps([r.to_json() for r in results], indent=2))
