"""What grouping decode requests by routing path can save, and what the scheduler's paths reach of it (ExpertFlow).

No model: groups of `--sizes` requests drawn at random from a trace's held-back requests (the last `--test` of
DeepSeek-V2-Lite's, the last ones of Llama-4-Maverick's decode routing), each at a random decode position t; the
cost of a grouping is the distinct (layer, expert) pairs of the requests' token t + 1, summed over its steps. Rows:
- `one step of all` (FIFO-2T: every request in one step, where the engine may take it);
- `fifo halves` (two steps, by arrival);
- `2-means, previous token` (the engine's paths without a forecast: each request's token t);
- `2-means, predicted paths` (the paths a transition predictor fitted on the trace's first `--fit` requests, disjoint
  from the drawn ones, forecasts for token t + 1 from token t at the same layer: what `--predictor transition` hands
  the scheduler);
- `2-means, path predictor` (ExpertFlow's own: `--predictor path`, the small shape fitted for `--path-epochs` on the
  same first `--fit` requests, forecasts token t + 1's path from the tokens up to t + 1, which a scheduler knows
  before that token's step runs; only on a trace with its tokens, DeepSeek-V2-Lite's);
- `2-means + swaps, previous token` and `2-means + swaps, path predictor` (the engine's grouping, runtime/grouping.py
  `group`: 2-means, then the best swap of one member of each group until none helps; the path predictor's paths as
  its probabilities, the swaps lowering the expected distinct pairs), what `--batch-policy expertflow` runs without
  a predictor and with `--predictor path`;
- `2-means, true next token` (an oracle predictor);
- `best found`: the exact optimum over every balanced split at 16 requests or fewer, else 2-means on the true next
  token followed by pairwise swaps until none helps (a local optimum: an upper bound on the best).
Each figure is the mean over `--draws` groups, stated against `fifo halves` (the scheduler's own baseline) and
against one step of all.

    python -m benchmarks.grouping [--sizes 16 32 64] [--draws 40 20 10] [--path-epochs 20]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS, SHARED, converted, machine_state, print_table, write_json
from moepager.predictors.path import SMALL, PathPredictor, fit_path
from moepager.predictors.transition import TransitionPredictor
from moepager.runtime.grouping import (
    balanced_two_means,
    exact_best_split,
    group,
    path_of,
    split_cost,
    swap_search,
    union_size,
)
from moepager.trace.format import DECODE, TraceReader
from moepager.trace.predict import row_token_ids

ROWS = ("one step of all", "fifo halves", "2-means, previous token", "2-means + swaps, previous token",
        "2-means, predicted paths", "2-means, path predictor", "2-means + swaps, path predictor",
        "2-means, true next token", "best found")
PREDICTED = {"2-means, predicted paths": "transition", "2-means, path predictor": "path",
             "2-means + swaps, path predictor": "path"}
PATH_ROWS = ("2-means, path predictor", "2-means + swaps, path predictor")


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--draws", type=int, nargs="+", default=[40, 20, 10], help="groups drawn at each size")
    p.add_argument("--traces", nargs="+", default=["deepseek-v2-lite", "llama4-maverick"])
    p.add_argument("--fit", type=int, default=None,
                   help="requests the predictor is fitted on, from the start (default: DeepSeek 1000, Llama-4 60)")
    p.add_argument("--test", type=int, default=None,
                   help="held-back requests the groups come from, the last ones (default: DeepSeek 400, Llama-4 75)")
    p.add_argument("--path-epochs", type=int, default=20,
                   help="epochs the path predictor is fitted for (0: no path predictor row)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="grouping")
    return p.parse_args()


def trace_path(name: str) -> Path:
    if name == "deepseek-v2-lite":
        return converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
    return converted("expert-selection-json", SHARED / "llama4-maverick" / "traffic-gen" / "llama4-mmlu-anatomy",
                     "llama4-maverick")


def decode_tokens(name: str, reader: TraceReader, indices: Sequence[int]) -> list[tuple[np.ndarray, list[int]]]:
    """Each request's decode-order routing [T, L, K] and its token ids (empty where the trace has none): DeepSeek's
    prompts are replayed token by token (every token a decode step: the trace's README), Llama-4's decode tokens
    only (no tokens recorded)."""
    out = []
    for i in indices:
        q = reader.request(i)
        decode = slice(None) if name == "deepseek-v2-lite" else q.phase_T == DECODE
        tokens = row_token_ids(q)
        out.append((np.asarray(q.ids_TLK[decode]), tokens[decode].tolist() if len(tokens) else []))
    return out


def path_predictor(name: str, fitted: list[tuple[np.ndarray, list[int]]], num_experts: int, epochs: int,
                   seed: int) -> PathPredictor:
    """ExpertFlow's path predictor (the small shape) fitted on the `fitted` requests, cached under results/."""
    cache = RESULTS / "predictors" / f"grouping-path-{name}-{len(fitted)}r-{epochs}e-s{seed}.pt"
    if cache.exists():
        return PathPredictor.from_state(torch.load(cache, weights_only=True))
    print(f"fitting the path predictor on {len(fitted)} {name} requests, {epochs} epochs")
    routes = [torch.from_numpy(ids.astype(np.int64)) for ids, _ in fitted]
    predictor = fit_path([tokens for _, tokens in fitted], routes, num_experts, SMALL, epochs, seed=seed)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + ".tmp")
    predictor.save(tmp)
    tmp.replace(cache)
    return predictor


def forecast_paths(predictor: PathPredictor, tokens: list[int]) -> np.ndarray:
    """The predictor's probabilities of each of a request's tokens' routing [T, L, E] (each token's forecast from the
    tokens up to it: a new request, its tokens in order)."""
    predictor.start_iteration(torch.tensor(tokens), None)
    probs = np.stack([predictor.forecast(layer, 0).probs_NE.float().numpy() for layer in range(predictor.num_layers)],
                     1)
    predictor.start_iteration(torch.zeros(0, dtype=torch.long), None)
    return probs


def top_path(probs_LE: np.ndarray, k: int) -> np.ndarray:
    """A forecast's path: its k most likely experts at each layer, as bits [L * E]."""
    return path_of(np.argsort(-probs_LE, 1, kind="stable")[:, :k], probs_LE.shape[1])


def recall(predicted: np.ndarray, nxt: np.ndarray) -> float:
    """The share of the true next tokens' (layer, expert) pairs that the predicted paths name."""
    return float((predicted & nxt).sum() / max(1, nxt.sum()))


def next_token_paths(requests: list[np.ndarray], num_experts: int, k: int) -> Callable[[np.ndarray], np.ndarray]:
    """A transition predictor (`--predictor transition`) fitted on whole `requests` at distance L (layer l of the next
    token from layer l of this one): the forecast path of a token's successor, each layer's k most likely experts."""
    layers = requests[0].shape[1]
    ids = torch.from_numpy(np.concatenate(requests).astype(np.int64))
    request = torch.cat([torch.full((len(r),), i) for i, r in enumerate(requests)])
    predictor = TransitionPredictor.fit(ids, request, num_experts, [layers])
    tables = [predictor.backed_off((layer, layer, 1)).numpy() for layer in range(layers)]

    def path(ids_LK: np.ndarray) -> np.ndarray:
        out = np.zeros((layers, num_experts), bool)
        for layer, table in enumerate(tables):
            p = table[ids_LK[layer][ids_LK[layer] >= 0]].sum(0)
            out[layer, np.argsort(-p, kind="stable")[:k]] = True
        return out.reshape(-1)
    return path


def costs(prev: np.ndarray, predicted: dict[str, np.ndarray], nxt: np.ndarray) -> dict[str, int]:
    """Each row's cost (distinct pairs of the next token over its steps) for one group's paths (`predicted`: each
    predictor row's, where it has them)."""
    n = len(nxt)
    out = {"one step of all": union_size(nxt, range(n)),
           "fifo halves": split_cost(nxt, range((n + 1) // 2), range((n + 1) // 2, n))}
    for row, paths in (("2-means, previous token", prev), ("2-means + swaps, previous token", prev),
                       *predicted.items(), ("2-means, true next token", nxt)):
        out[row] = split_cost(nxt, *(group(paths) if row.startswith("2-means + swaps") else balanced_two_means(paths)))
    best = exact_best_split(nxt) if n <= 16 else swap_search(nxt, *balanced_two_means(nxt))
    out["best found"] = split_cost(nxt, *best)
    return out


def measure(name: str, sizes: Sequence[int], draws: Sequence[int], fit: int | None, test: int | None,
            seed: int, path_epochs: int) -> list[dict[str, Any]]:
    with TraceReader(trace_path(name)) as reader:
        h, total = reader.header, len(reader)
        fit = fit or (1000 if name == "deepseek-v2-lite" else 60)
        test = test or (400 if name == "deepseek-v2-lite" else 75)
        if fit + test > total:
            raise SystemExit(f"{name}: --fit {fit} and --test {test} overlap in its {total} requests")
        fitted = decode_tokens(name, reader, range(fit))
        held = [r for r in decode_tokens(name, reader, range(total - test, total)) if len(r[0]) >= 24]
    predicted_path = next_token_paths([ids for ids, _ in fitted if len(ids) > 1], h.num_experts, h.top_k)
    with_tokens = path_epochs > 0 and all(len(tokens) == len(ids) for ids, tokens in fitted + held)
    path_probs = None
    if with_tokens:
        predictor = path_predictor(name, [r for r in fitted if len(r[0])], h.num_experts, path_epochs, seed)
        path_probs = [forecast_paths(predictor, tokens) for _, tokens in held]
    rng, rows = np.random.default_rng(seed), []
    for n, count in zip(sizes, draws):
        if n > len(held):
            continue
        sums = {row: 0.0 for row in ROWS}
        recalls = {row: 0.0 for row in PREDICTED}
        for _ in range(count):
            pick = rng.choice(len(held), n, replace=False)
            chosen = [held[i][0] for i in pick]
            t = int(rng.integers(4, min(len(ids) for ids in chosen) - 1))
            prev = np.stack([path_of(ids[t - 1], h.num_experts) for ids in chosen])
            nxt = np.stack([path_of(ids[t], h.num_experts) for ids in chosen])
            predicted = {"2-means, predicted paths": np.stack([predicted_path(ids[t - 1]) for ids in chosen])}
            if path_probs is not None:
                probs = np.stack([path_probs[i][t].reshape(-1) for i in pick])
                predicted["2-means, path predictor"] = np.stack([top_path(path_probs[i][t], h.top_k) for i in pick])
                predicted["2-means + swaps, path predictor"] = probs
            top = predicted.get("2-means, path predictor")
            for row, paths in predicted.items():  # probabilities: their top k's recall
                recalls[row] += recall(paths if paths.dtype == np.bool_ else top, nxt) / count
            for row, c in costs(prev, predicted, nxt).items():
                sums[row] += c / count
        for row in ROWS:
            if row in PATH_ROWS and path_probs is None:
                continue
            rows.append({"trace": name, "requests": n, "draws": count, "grouping": row, "pairs": sums[row],
                         "vs_fifo_halves": sums[row] / sums["fifo halves"],
                         "vs_one_step": sums[row] / sums["one step of all"],
                         "per_layer_per_step": sums[row] / (h.num_layers * (1 if row == ROWS[0] else 2)),
                         "recall": recalls.get(row), "experts": h.num_experts, "top_k": h.top_k,
                         "fit_requests": fit, "test_requests": test,
                         "path_epochs": path_epochs if row in PATH_ROWS else None})
    return rows


def main() -> None:
    args = arguments()
    if len(args.draws) != len(args.sizes):
        raise SystemExit("--draws takes one count per --sizes entry")
    state = machine_state()
    rows = []
    for name in args.traces:
        if not (SHARED / name).exists():
            print(f"skipped {name}: no trace under {SHARED}")
            continue
        rows += measure(name, args.sizes, args.draws, args.fit, args.test, args.seed, args.path_epochs)
    print("distinct (layer, expert) pairs of the next token over a grouping's steps (mean over draws; recall: the "
          "share of the next token's pairs its predicted paths name):")
    print_table(["trace", "requests", "grouping", "pairs", "x fifo halves", "x one step", "recall"],
                [[r["trace"], r["requests"], r["grouping"], r["pairs"], r["vs_fifo_halves"], r["vs_one_step"],
                  "" if r["recall"] is None else r["recall"]] for r in rows])
    out = write_json(args.out, {"machine": state, "args": vars(args), "rows": rows})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
