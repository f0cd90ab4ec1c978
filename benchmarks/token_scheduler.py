"""ExpertFlow's token scheduler (`--batch-policy expertflow`) against FIFO under load, experts paged at one budget.

Three schedules of the same requests, `--clients` of them at once (continuous batching), each a fresh engine:
- `fifo` with `--max-num-seqs` = clients: every request in every step;
- `fifo` with `--max-num-seqs` = clients / 2: half of them at a time, the rest waiting;
- `expertflow` with `--max-num-seqs` = clients / 2: all of them running, two groups of similar routing paths
  decoding in turns (each step as large as the second FIFO's).
Per schedule: distinct experts per decode step (the store's accesses per step), expert bytes read per output token,
decode tokens/s, and the requests whose tokens equal the first schedule's (a batched step rounds a row differently
from a smaller batch, so an argmax can flip; `--deterministic` rows would be equal).
Beside them, what grouping could gain at best on the DeepSeek-V2-Lite trace (`bound`, no model): for groups of
`--clients` random requests at a random decode position, the distinct (layer, expert) pairs of their next token
summed over the two halves of a FIFO split, of 2-means on each request's previous token (what the engine does),
and of 2-means on the next token itself (an oracle predictor), against one batch of all.
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
from typing import Any

import numpy as np
import torch

from benchmarks.common import SHARED, demo_documents, ensure_model, machine_state, print_table, write_json
from moepager.config import EngineConfig, SchedulerConfig, StoreConfig
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
    p.add_argument("--workloads", nargs="+", default=["replay", "built-in"], choices=["replay", "built-in"])
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
            "same_tokens": None if reference is None else sum(a == b for a, b in zip(tokens, reference))}


def replayed(args: argparse.Namespace) -> list[dict]:
    from benchmarks.offload_replay import deepseek_trace, replayed_requests

    path = ensure_model(f"deepseek-v2-lite-L{args.layers + 1}", "deepseek-v2-lite", args.layers + 1)
    trace = deepseek_trace(args.layers)
    requests = replayed_requests(trace, 200, args.clients, args.prompt + args.decode)
    spec = ReplaySpec(trace, requests, args.prompt, "match", args.decode)
    rows, reference = [], None
    for label, scheduler in schedules(args.clients):
        llm = LLM(config=EngineConfig(model=str(path), threads=args.threads, scheduler=scheduler,
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
    from moepager.runtime.grouping import balanced_two_means, union_size
    from moepager.trace.format import TraceReader

    trace = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
    with TraceReader(trace) as reader:
        h = reader.header
        requests = [q for q in (reader.request(i) for i in range(len(reader) - 400, len(reader)))
                    if q.num_tokens >= 64]

    def path(q: Any, t: int) -> np.ndarray:
        p = np.zeros((h.num_layers, h.num_experts), bool)
        for layer, ids in enumerate(q.ids_TLK[t]):
            p[layer, ids[ids >= 0]] = True
        return p.reshape(-1)

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


def close(llm: LLM) -> None:
    if llm.store is not None:
        llm.store.close()
    del llm
    gc.collect()


def main() -> None:
    args = arguments().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    state = machine_state()
    rows: list[dict] = []
    if "replay" in args.workloads and (SHARED / "deepseek-v2-lite").exists():
        rows += replayed(args)
    if "built-in" in args.workloads:
        rows += built_in(args)
    for r in rows:
        base = next(b for b in rows if b["workload"] == r["workload"])
        r["bytes_vs_first"] = r["expert_MiB_per_token"] / base["expert_MiB_per_token"] \
            if base["expert_MiB_per_token"] else None
    print(f"{args.clients} clients, expert budget {args.budget}, {args.decode} decode steps each:")
    print_table(["workload", "schedule", "experts/step", "MiB/token", "x first", "tok/s", "hit %", "same tokens"],
                [[r["workload"], r["schedule"], r["distinct_experts_per_step"], r["expert_MiB_per_token"],
                  r["bytes_vs_first"] or "-", r["decode_tok_s"] or "-", 100 * (r["hit_rate"] or 0),
                  "-" if r["same_tokens"] is None else f"{r['same_tokens']}/{args.clients}"] for r in rows])
    bound = grouping_bound(args) if (SHARED / "deepseek-v2-lite").exists() else []
    if bound:
        print(f"\nbound on the DeepSeek-V2-Lite trace, {args.clients} requests: distinct (layer, expert) pairs of the "
              "next token over two steps")
        print_table(["grouping", "pairs", "x fifo halves"],
                    [[b["grouping"], b["pairs_per_two_steps"], b["vs_fifo_halves"]] for b in bound])
    out = write_json("token_scheduler", {"machine": state, "args": vars(args), "rows": rows, "bound": bound})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
