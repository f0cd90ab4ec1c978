"""ExpertFlow's token scheduler (`--batch-policy expertflow`) against FIFO under load, experts paged at one budget.

Three schedules of the same requests, `--clients` of them at once (continuous batching), each a fresh engine:
- `fifo` with `--max-num-seqs` = clients: every request in every step;
- `fifo` with `--max-num-seqs` = clients / 2: half of them at a time, the rest waiting;
- `expertflow` with `--max-num-seqs` = clients / 2: all of them running, two groups of similar routing paths
  decoding in turns (each step as large as the second FIFO's);
- replayed routing only: `expertflow` again, its paths the next-token forecasts of a transition predictor fitted on
  the trace's first 200 requests (`--predictor transition --prefetch-k 0`: forecasts only, nothing prefetched), and
  of ExpertFlow's path predictor fitted on them (`--predictor path --prefetch-k 0`, the small shape, 20 epochs: each
  decoding request's path forecast from its next token when the groups are formed).
Per schedule: distinct experts per decode step (the store's accesses per step), expert bytes read per output token,
decode tokens/s, and the requests whose tokens equal the first schedule's (a batched step rounds a row differently
from a smaller batch, so an argmax can flip; `--deterministic` rows would be equal).
Beside them, what grouping could gain at best on the DeepSeek-V2-Lite trace (`bound`, no model): for groups of
`--clients` random requests at a random decode position, the distinct (layer, expert) pairs of their next token
summed over the two halves of a FIFO split, of 2-means on each request's previous token (what the engine does),
and of 2-means on the next token itself (an oracle predictor), against one batch of all.
Simulated (`simulate --order engine`, LRFU, warm start): the same three schedules over the DeepSeek-V2-Lite and
Mixtral traces and the built-in model's recording, `--clients` requests at a time, at 12.5/25/50% of the experts:
expert loads per output token and distinct experts per decode pass (a table, and results/token_scheduler.png).
Two workloads:
- replayed routing (`--replay`, the default when the trace is there): the DeepSeek-V2-Lite geometry with `--layers`
  MoE layers replaying the DeepSeek-V2-Lite trace's routing (`generate --route-from ... --route-concurrency`), its
  requests cut into a `--prompt`-token prompt and `--decode` steps;
- the built-in model generating from the corpus (its own routing).

    python -m benchmarks.token_scheduler [--clients 16] [--budget 25%] [--layers 2] [--decode 16]
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    SHARED,
    demo_documents,
    ensure_model,
    measured_workloads,
    print_table,
    write_json,
)
from moepager.config import EngineConfig, PrefetchConfig, SchedulerConfig, StoreConfig
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec
from moepager.runtime.sampling import SamplingParams


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--budget", default="25%")
    p.add_argument("--layers", type=int, default=2, help="replay: MoE layers of the DeepSeek-V2-Lite geometry")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--workloads", nargs="+", default=["replay", "built-in", "simulated"],
                   choices=["replay", "built-in", "simulated"])
    return p


def schedules(clients: int) -> list[tuple[str, SchedulerConfig]]:
    half = max(1, clients // 2)
    return [(f"fifo, {clients} a step", SchedulerConfig(max_num_seqs=clients)),
            (f"fifo, {half} a step", SchedulerConfig(max_num_seqs=half)),
            (f"expertflow, {half} a step", SchedulerConfig(max_num_seqs=half, batch_policy="expertflow"))]


def figures(llm: LLM, tokens: list[list[int]], reference: list[list[int]] | None) -> dict[str, Any]:
    s = llm.last_stats
    decode = s.sections["experts"].to_dict().get("decode", {})
    steps = len(s.tpot_s)
    decoded = s.generated_tokens - s.num_prompts
    return {"decode_steps": steps, "decoded": decoded,
            "distinct_experts_per_step": decode.get("accesses", 0) / max(steps, 1),
            "expert_MiB_per_token": decode.get("bytes_disk", 0) / 2**20 / max(decoded, 1),
            "decode_tok_s": decoded / s.decode_s if s.decode_s else None,
            "hit_rate": decode.get("hit_rate"),
            "same_tokens": None if reference is None else sum(a == b for a, b in zip(tokens, reference)),
            "grouping_paths": s.sections["token scheduler"].to_dict() if "token scheduler" in s.sections else None}


def replayed(args: argparse.Namespace) -> list[dict]:
    from benchmarks.offload_replay import deepseek_trace, fitted_predictors, replayed_requests

    path = ensure_model(f"deepseek-v2-lite-L{args.layers + 1}", "deepseek-v2-lite", args.layers + 1)
    trace = deepseek_trace(args.layers)
    requests = replayed_requests(trace, 200, args.clients, args.prompt + args.decode)
    spec = ReplaySpec(trace, requests, args.prompt, "match", args.decode)
    files = fitted_predictors(trace, list(range(200)), {("transition", "tokens"), ("path", "tokens")})
    half = schedules(args.clients)[-1][1]
    predicted = [(f"expertflow, {half.max_num_seqs} a step, {name}-predicted paths", half,
                  PrefetchConfig(name, file=str(files[name, "tokens"]), per_row=0))  # paths only, no loads
                 for name in ("transition", "path")]
    rows, reference = [], None
    for label, scheduler, prefetch in [(label, scheduler, PrefetchConfig()) for label, scheduler in
                                       schedules(args.clients)] + predicted:
        llm = LLM(config=EngineConfig(model=str(path), threads=args.threads, scheduler=scheduler, prefetch=prefetch,
                                      store=StoreConfig(expert_memory=args.budget)), show_progress=False)
        out = llm.replay(spec, concurrency=args.clients)
        tokens = [c.token_ids for c in out]
        rows.append({"workload": "replay", "schedule": label} | figures(llm, tokens, reference))
        reference = reference or tokens
        close(llm)
    return rows


def built_in(args: argparse.Namespace) -> list[dict]:
    docs, _ = demo_documents()
    prompts = [d[:120] for d in docs[: args.clients]]
    params = SamplingParams(max_tokens=args.decode + 1, ignore_eos=True)
    rows, reference = [], None
    for label, scheduler in schedules(args.clients):
        llm = LLM(config=EngineConfig(threads=args.threads, scheduler=scheduler,
                                      store=StoreConfig(expert_memory=args.budget)), show_progress=False)
        tokens = [c.token_ids for c in llm.generate(prompts, params)]
        rows.append({"workload": "built-in", "schedule": label} | figures(llm, tokens, reference))
        reference = reference or tokens
        close(llm)
    return rows


def grouping_bound(args: argparse.Namespace, trials: int = 40) -> list[dict]:
    """The module note's `bound`: mean distinct (layer, expert) pairs per pair of steps, each grouping."""
    from benchmarks.common import converted
    from moepager.runtime.grouping import balanced_two_means, path_of, union_size
    from moepager.trace.format import TraceReader

    trace = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
    with TraceReader(trace) as reader:
        h = reader.header
        requests = [q for q in (reader.request(i) for i in range(len(reader) - 400, len(reader)))
                    if q.num_tokens >= 64]

    def path(q: Any, t: int) -> np.ndarray:
        return path_of(q.ids_TLK[t], h.num_experts)

    rng, n = np.random.default_rng(0), args.clients
    sums: dict[str, list[int]] = {"one batch": [], "fifo halves": [], "2-means, last token": [],
                                  "2-means, next token (oracle)": []}
    for _ in range(trials):
        chosen = [requests[i] for i in rng.choice(len(requests), n, replace=False)]
        t = int(rng.integers(8, 63))
        nxt = np.stack([path(q, t) for q in chosen])
        prev = np.stack([path(q, t - 1) for q in chosen])
        sums["one batch"].append(union_size(nxt, range(n)))
        sums["fifo halves"].append(union_size(nxt, range(n // 2)) + union_size(nxt, range(n // 2, n)))
        for key, paths in (("2-means, last token", prev), ("2-means, next token (oracle)", nxt)):
            a, b = balanced_two_means(paths)
            sums[key].append(union_size(nxt, a) + union_size(nxt, b))
    fifo = float(np.mean(sums["fifo halves"]))
    return [{"grouping": k, "pairs_per_two_steps": float(np.mean(v)), "vs_fifo_halves": float(np.mean(v)) / fifo}
            for k, v in sums.items()]


def simulated(args: argparse.Namespace) -> list[dict]:
    """The three schedules replayed by the simulator in the engine's step order on every trace (module note)."""
    from benchmarks.common import RESULTS, converted, record_demo_trace
    from moepager.runtime.step_order import engine_steps
    from moepager.trace.format import DECODE, TraceReader
    from moepager.trace.simulate import SimSpec, simulate
    from moepager.trace.workload import Cut, load_workload

    docs, _ = demo_documents()
    traces = {"deepseek-v2-lite": converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite"),
              "mixtral-8x7b": converted("mixtral-jsonl", SHARED / "mixtral-8x7b" / "routing_data_collected",
                                        "mixtral-8x7b"),
              "built-in": record_demo_trace(RESULTS / "traces" / "demo-hybrid.mpt", docs[:48], 64, max_new=24)}
    rows = []
    for name, path in traces.items():
        with TraceReader(path) as reader:
            long = [i for i in range(len(reader)) if reader.request(i).num_tokens >= args.prompt + args.decode]
            h = reader.header
        chosen = long[: 4 * args.clients]
        base = load_workload(str(path), "recorded", requests=chosen, cut=Cut(args.prompt, args.decode))
        for label, scheduler in schedules(args.clients):
            work = engine_steps(base, scheduler, args.clients)
            decode = work.step_phase == DECODE
            for share in (0.125, 0.25, 0.5):
                per_layer = max(h.top_k, round(share * h.num_experts))
                result = simulate(work, SimSpec("lrfu", per_layer, warm=True))
                tokens = int(np.diff(work.step_ptr)[decode].sum())
                rows.append({"trace": name, "schedule": label, "budget": f"{100 * share:g}%", "per_layer": per_layer,
                             "requests": len(chosen),
                             "loads_per_decode_token": float(result.demand_loads_SL[decode].sum()) / max(tokens, 1),
                             "experts_per_decode_pass": float(result.requested_SL[decode].sum()) / max(decode.sum(), 1),
                             "decode_hit_rate": result.hit_rate(DECODE)})
    for r in rows:
        first = next(b for b in rows if (b["trace"], b["budget"]) == (r["trace"], r["budget"]))
        r["loads_vs_first"] = r["loads_per_decode_token"] / first["loads_per_decode_token"] \
            if first["loads_per_decode_token"] else None
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8))
    for ax, name in zip(np.atleast_1d(axes), names):
        mine = [r for r in rows if r["trace"] == name]
        for label in dict.fromkeys(r["schedule"] for r in mine):
            points = [(r["budget"], r["loads_per_decode_token"]) for r in mine if r["schedule"] == label]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set(title=name, xlabel="expert budget", ylabel="expert loads per decode token")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def close(llm: LLM) -> None:
    if llm.store is not None:
        llm.store.close()
    del llm
    gc.collect()


def main() -> None:
    args = arguments().parse_args()
    state, rows = measured_workloads(args, replayed, built_in)
    for r in rows:
        base = next(b for b in rows if b["workload"] == r["workload"])
        r["bytes_vs_first"] = r["expert_MiB_per_token"] / base["expert_MiB_per_token"] \
            if base["expert_MiB_per_token"] else None
    print(f"{args.clients} clients, expert budget {args.budget}, {args.decode} decode steps each:")
    print_table(["workload", "schedule", "experts/step", "MiB/token", "x first", "tok/s", "hit %", "same tokens",
                 "paths: lookahead / forecast / routed"],
                [[r["workload"], r["schedule"], r["distinct_experts_per_step"], r["expert_MiB_per_token"],
                  r["bytes_vs_first"] or "-", r["decode_tok_s"] or "-", 100 * (r["hit_rate"] or 0),
                  "-" if r["same_tokens"] is None else f"{r['same_tokens']}/{args.clients}",
                  "-" if (g := r["grouping_paths"]) is None else
                  f"{g['lookahead']} / {g['forecast_passes']} / {g['routed_passes']}"] for r in rows])
    bound = grouping_bound(args) if (SHARED / "deepseek-v2-lite").exists() else []
    if bound:
        print(f"\nbound on the DeepSeek-V2-Lite trace, {args.clients} requests: distinct (layer, expert) pairs of the "
              "next token over two steps")
        print_table(["grouping", "pairs", "x fifo halves"],
                    [[b["grouping"], b["pairs_per_two_steps"], b["vs_fifo_halves"]] for b in bound])
    sim = simulated(args) if "simulated" in args.workloads and (SHARED / "deepseek-v2-lite").exists() else []
    if sim:
        print(f"\nsimulated in the engine's step order, {args.clients} requests at a time (LRFU, warm):")
        print_table(["trace", "schedule", "budget", "loads/decode token", "x first", "experts/decode pass", "hit %"],
                    [[r["trace"], r["schedule"], r["budget"], r["loads_per_decode_token"], r["loads_vs_first"] or "-",
                      r["experts_per_decode_pass"], 100 * r["decode_hit_rate"]] for r in sim])
        from benchmarks.common import RESULTS

        plot(sim, RESULTS / "token_scheduler.png")
        print(f"plot: {RESULTS / 'token_scheduler.png'}")
    out = write_json("token_scheduler", {"machine": state, "args": vars(args), "rows": rows, "bound": bound,
                                         "simulated": sim})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
