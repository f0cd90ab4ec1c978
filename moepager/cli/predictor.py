"""`moepager predictor fit`: learn a predictor from a routing trace and write it to a file the engine loads
with `generate --predictor NAME --predictor-file PATH`."""

from __future__ import annotations

import argparse

from tqdm import tqdm

from moepager.atomic_io import atomic_file, check_file
from moepager.predictors import FITTED, PredictorError
from moepager.predictors.head import DEFAULT_HIDDEN, DEFAULT_STEPS
from moepager.predictors.path import SHAPES
from moepager.trace.fit import FITTERS
from moepager.trace.format import TraceReader

HELP = "fit a routing predictor (transition tables, fMoE expert maps, SMoE token-wise) on a trace"


def parse_ints(text: str, flag: str, words: dict[str, int] | None = None) -> list[int]:
    """Comma-separated positive integers (and the named values in `words`, e.g. pass)."""
    words = words or {}
    values = []
    for item in (x.strip() for x in text.split(",")):
        if item in words:
            values.append(words[item])
            continue
        try:
            values.append(int(item))
        except ValueError:
            named = f" or {', '.join(words)}" if words else ""
            raise PredictorError(f"{flag} takes comma-separated integers{named}, got '{text}'") from None
        if values[-1] < 1:
            raise PredictorError(f"{flag} needs positive integers, got '{text}'")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="predictor_command", required=True, parser_class=type(p))
    f = sub.add_parser("fit", help="fit a predictor on every request of a trace",
                       description="token-wise needs a trace recorded with --record-hidden")
    f.add_argument("--kind", required=True, choices=FITTED)
    f.add_argument("--trace", required=True, help="trace file (moepager format)")
    f.add_argument("--out", required=True, help="predictor file to write")
    f.add_argument("--force", action="store_true", help="replace an existing --out file")
    f.add_argument("--distances", help="transition, head: prefetch distances to fit (default 1,2,3; the head also L, "
                                        "the trace's MoE layers: the next token's forecast PLEC evicts by)")
    f.add_argument("--capacity", type=int, help="expert-map: maps kept (default 1000)")
    f.add_argument("--max-iterations", type=int,
                   help="expert-map: iterations sampled from the trace for the store (default 20000)")
    f.add_argument("--distance", type=int, help="expert-map: prefetch distance (redundancy weights)")
    f.add_argument("--neighbours", type=int,
                   help="expert-map: average the best N matching maps (default 1: fMoE's single best)")
    f.add_argument("--trajectory-only", action="store_true",
                   help="expert-map: match by routing trajectory only (no semantic embedding)")
    f.add_argument("--epochs", type=int, help="token-wise: full-batch Adam epochs (default 200)")
    f.add_argument("--sources", type=int,
                   help="transition: observed layers combined per forecast (default 1: co-occurrence with back-off)")
    f.add_argument("--alpha", type=float,
                   help="transition: back-off mass towards the target layer's frequencies (default 8)")
    f.add_argument("--no-tokens", action="store_true",
                   help="head: leave the token out (when the engine will not see the trace's tokens: a model with "
                        "another tokenizer; a replay hands predictors the trace's own)")
    f.add_argument("--head-steps", type=int,
                   help=f"head: optimiser steps per head (default {DEFAULT_STEPS}, whatever the trace's size)")
    f.add_argument("--head-epochs", type=int, help="head: passes over the trace instead of --head-steps")
    f.add_argument("--head-hidden", type=int, metavar="H",
                   help=f"head: an MLP with H hidden units per layer beside the linear head (0: the linear head "
                        f"alone; default: linear or {DEFAULT_HIDDEN}, whichever forecasts 15%% of the training "
                        "requests, held out, better; it says which)")
    f.add_argument("--path-epochs", type=int, help="path: passes over the trace (default 20)")
    f.add_argument("--seed", type=int, help="head, path: training seed")
    f.add_argument("--shape", choices=sorted(SHAPES),
                   help="path: small (2 causal layers, d_model 64), paper (ExpertFlow's d_model 32, d_ff 2048, 6 "
                        "causal layers) or t5 (the paper's 6 + 6 encoder-decoder: the encoder reads the prompt)")
    f.add_argument("--prompt", type=int, metavar="N",
                   help="path (t5): each request's first N tokens are its prompt (as a replay with --route-prompt N "
                        "runs it; default: the recorded phases)")
    f.add_argument("--resume", help="path: checkpoint after every epoch here, and continue from it if it exists")


def default_distances(kind: str, num_layers: int) -> tuple[int, ...]:
    """1, 2, 3; for the head those within the trace's MoE layers and L, the next token's forecast (PLEC's)."""
    if kind != "head":
        return 1, 2, 3
    return tuple(sorted({d for d in (1, 2, 3) if d <= num_layers} | {num_layers}))


OPTIONS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "distances": ("distances", None), "sources": ("sources", None), "alpha": ("alpha", None),
    "capacity": ("capacity", None), "distance": ("distance", None), "max_iterations": ("max_iterations", None),
    "neighbours": ("neighbours", None), "trajectory_only": ("trajectory_only", None),
    "epochs": ("epochs", ("token-wise",)), "head_epochs": ("epochs", ("head",)), "path_epochs": ("epochs", ("path",)),
    "head_hidden": ("hidden", None), "head_steps": ("steps", ("head",)), "no_tokens": ("tokens", None),
    "seed": ("seed", None), "shape": ("shape", None),
    "prompt": ("prompt", None), "resume": ("resume", None),
}
"""`predictor fit` option (argparse dest) -> (the fit configuration's field, the kinds it applies to; None: every kind
whose configuration has that field)."""


def fit_config(kind: str, args: argparse.Namespace, distances: tuple[int, ...]) -> object:
    """The kind's fit configuration from the options given; an option that does nothing for the kind is refused."""
    fitter, given = FITTERS[kind], {}
    for dest, (name, kinds) in OPTIONS.items():
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        if (kinds is not None and kind not in kinds) or name not in fitter.config.__dataclass_fields__:
            flag = "--" + dest.replace("_", "-")
            raise PredictorError(f"{flag} does nothing for --kind {kind}")
        given[name] = (not value) if dest == "no_tokens" else value
    if "distances" in fitter.config.__dataclass_fields__:
        given["distances"] = distances
    return fitter.configure(kind, **given)


def run(args: argparse.Namespace) -> int:
    out = check_file(args.out, "--out", args.force, {"--trace": args.trace})
    with TraceReader(args.trace) as reader:
        if args.kind == "token-wise" and (not len(reader) or reader.request(0).hidden_TLD is None):
            raise PredictorError(f"token-wise learns from router inputs, which {args.trace} does not hold; record a "
                                 f"trace with `generate --record-trace PATH --record-hidden`")
        everything = list(range(len(reader)))
        fitter = FITTERS[args.kind]
        distances = tuple(parse_ints(args.distances, "--distances")) if args.distances else default_distances(
            args.kind, reader.header.num_layers)
        options = fit_config(args.kind, args, distances)
        with tqdm(total=fitter.total(everything, options), unit=fitter.unit, desc=args.kind) as bar:
            fitted = fitter.fit(reader, everything, options, bar.update)
    with atomic_file(out) as tmp:
        fitted.save(tmp)
    print(f"wrote {args.out} ({args.kind}, fitted on {len(everything)} requests of {args.trace})")
    return 0
